"""The ``rayfleet`` command line (also ``python -m rayfleet``).

This module holds the parser and ``main()``. Every command lives in its own module of this
package: the fleet commands in ``rayfleet.cli.fleet``, each other command in the module
``AREA_COMMANDS`` names, which adds it through ``register(subparsers)``; this module only wires
them together. Handlers return an exit code; user mistakes (``RayfleetError``) print one clear
line and exit 2.

Design decisions:
- Fast answers: ``rayfleet --help`` and argument errors must not pay for torch or Ray (seconds
  of imports). So this module imports nothing heavy, the fleet commands import their
  dependencies inside their handlers, and a command's module is imported only when its command
  is the one being run: ``rayfleet --help`` lists those commands from ``AREA_COMMANDS``' one-line
  help texts (a unit test keeps them equal to what the modules register).
- The command is the first argument that is not an option (the top-level parser has no options
  of its own but ``-h`` and ``--version``), so it is known before the parser is built.
- The module is not called ``main.py``: ``rayfleet.cli`` re-exports the function ``main``, which
  would then hide a submodule of the same name (``rayfleet.cli.main`` would be the function).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rayfleet.cli import fleet
from rayfleet.errors import RayfleetError

__all__ = ["main", "build_parser", "AREA_COMMANDS"]

# command -> (module with its ``register``, the help line ``rayfleet --help`` shows for it)
AREA_COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("rayfleet.cli.plan", "rank parallel plans (TP/PP/DP/EP/CP) for a model on a fleet"),
    "data": ("rayfleet.cli.data", "prepare training data"),
    "node": ("rayfleet.cli.node", "start/stop this machine's node of a `ray up` cluster"),
    "train": ("rayfleet.cli.train", "submit a training job (YAML spec) and follow its progress"),
    "job": ("rayfleet.cli.job", "jobs on the fleet: list, status, logs [--follow], stop, resume"),
    "serve": ("rayfleet.cli.serve", "serve a model (OpenAI API) from a serve YAML"),
    "queue": ("rayfleet.cli.queue", "hierarchical queues: quota, borrow limit, priority"),
    "model": ("rayfleet.cli.model", "import/export Hugging Face models"),
}
_ALL = "*"


def build_parser(command: str | None = _ALL) -> argparse.ArgumentParser:
    """The ``rayfleet`` parser with every area command (``command="*"``, the default) or with only
    ``command``'s area imported (others are listed by name and help line only)."""
    from rayfleet import __version__

    parser = argparse.ArgumentParser(prog="rayfleet", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"rayfleet {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    fleet.register(sub)
    for name, (module_name, help_) in AREA_COMMANDS.items():
        if command in (_ALL, name):
            importlib.import_module(module_name).register(sub)
        else:  # listed in `rayfleet --help`; never parsed (its command would have been imported)
            sub.add_parser(name, help=help_, add_help=False)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names (its first non-option argument), or None."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: ``sys.argv[1:]``); returns its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_in(argv)).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RayfleetError as exc:
        print(f"rayfleet {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
