"""``ray start`` for a node whose address is loopback: ``python -m rayfleet.platform.loopback_ray_start
start --node-ip-address=127.0.0.1 ...`` takes exactly ``ray start``'s arguments.

Design decisions:
- Ray 2.60's CLI turns ``--node-ip-address=127.0.0.1`` into the machine's routable address, and
  the node's servers then listen on every interface (``ray_compat.keep_loopback_node_ip``).
  This entry point is Ray's own CLI with that one rewrite undone, so a local fleet is closed to
  the network by binding, not only by its token. The rewrite happens in the CLI process only: it
  hands the address to every process it starts on the command line.
- Rejected: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (the documented single-machine switch) keeps
  the head on loopback but makes ``ray start --address`` refuse to start the other nodes.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    """Run Ray's ``ray`` CLI with ``argv`` (e.g. ``["start", "--head", ...]``) keeping loopback."""
    from ray.scripts.scripts import main as ray_main

    from rayfleet.platform import ray_compat

    ray_compat.keep_loopback_node_ip()
    sys.argv = ["ray", *argv]
    ray_main()


if __name__ == "__main__":
    main(sys.argv[1:])
