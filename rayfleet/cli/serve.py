"""``rayfleet serve serve.yaml``: deploy a model (``ServeSpec``) on the connected fleet.

    rayfleet serve examples/serve/colocated.yaml
    rayfleet serve examples/serve/disaggregated.yaml --address 127.0.0.1:6379 --detach
    rayfleet serve examples/serve/colocated.yaml --serve-config > serve_config.yaml  # for `serve deploy`

Without ``--detach`` the command stays in the foreground and deletes the app on Ctrl-C;
with it, the app keeps running (delete it with ``serve shutdown`` or ``serve delete NAME``).

Both ways admit the spec's pools through their queues the same way
(``serving/deploy/pool_admission.admit_app``): ``rayfleet serve`` before it starts the app, and
the printed config's ``import_path`` (the engine's ``app_builder``) inside the cluster before Serve
builds it. A pool its queue refuses fails ``rayfleet serve`` with the field, value and fix; under
``serve deploy`` the same message is the app's ``DEPLOY_FAILED`` status (``serve status``).
"""

from __future__ import annotations

import argparse
import time

__all__ = ["register", "handle_serve"]

_ADMISSION_NOTE = ("# rayfleet serve --serve-config: app_builder admits each pool through its queue before Serve\n"
                   "# builds the app; a refused pool shows as DEPLOY_FAILED in `serve status` (field, value, fix).\n")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` command to the ``rayfleet`` CLI."""
    p = subparsers.add_parser("serve", help="serve a model (OpenAI API) from a serve YAML",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="serve YAML (see examples/serve/)")
    p.add_argument("--address", default=None, help="host:port of the fleet (default: the local fleet)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (overrides http.port)")
    p.add_argument("--detach", action="store_true", help="return once serving; leave the app running")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the app to serve")
    p.add_argument("--serve-config", action="store_true",
                   help="print the equivalent Ray Serve config (for `serve deploy`/`serve run`) and exit")
    p.set_defaults(func=handle_serve)


def handle_serve(args: argparse.Namespace) -> int:
    from rayfleet.serving.deployer import deploy
    from rayfleet.serving.spec import ServeSpec, load_serve_spec

    spec = load_serve_spec(args.spec)
    if args.port is not None:
        spec = ServeSpec.parse({**spec.model_dump(), "http": {**spec.http.model_dump(), "port": args.port}})
    if args.serve_config:
        import yaml

        if spec.engine.kind == "vllm":
            from rayfleet.serving.vllm.app import serve_config
        else:
            from rayfleet.serving.openai_api.serve_app import serve_config

        print(_ADMISSION_NOTE + yaml.safe_dump(serve_config(spec), sort_keys=False), end="")
        return 0
    started = time.monotonic()
    served = deploy(spec, address=args.address, timeout_s=args.timeout)
    print(f"serving {spec.model.served_name!r} ({spec.mode}) as app {spec.name!r} in "
          f"{time.monotonic() - started:.1f}s")
    print(f"OpenAI base URL: {served.openai_base_url}   metrics: {served.url}/metrics")
    if served.api_key:  # the key itself stays in its file (terminals get logged)
        where = served.spec.http.api_keys.file or ", ".join(f"${n}" for n in served.spec.http.api_keys.env)
        print(f"API key (send 'Authorization: Bearer <key>'): in {where}")
    if args.detach:
        return 0
    print("Ctrl-C to stop")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        served.shutdown()
        print(f"deleted app {spec.name!r}")
    return 0
