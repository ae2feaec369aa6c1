"""Check on one real GPU what rayfleet can check there without Ray: FP8 GEMMs, the models,
the train loop on NCCL, the built-in engine, flash snapshots, and the cost model's constants.

    python scripts/gpu_check.py --out DIR                  # on a GPU node (cuda:0)
    python scripts/gpu_check.py --out DIR --device cpu     # every check that needs no CUDA (the unit tier runs this)
    python scripts/gpu_check.py --out DIR --only fp8,costmodel

Writes ``DIR/gpu_check.json`` (every check's status and unrounded figures, the machine, torch and
CUDA versions, the commit) after each group, so a run cut short still leaves what it measured, and
prints a readable summary. Exit status 1 when any check failed. Needs torch, transformers,
safetensors, pyarrow, fsspec, msgpack, pyyaml and pydantic; never Ray or vLLM (the GPU machines
this targets have neither). Results of real GPU runs are kept in ``benchmarks/results/gpu/``.

Design decisions: each group is a module of ``scripts/gpu_checks`` with ``run(ctx)``; a group
that raises records one failed ``crashed`` check with the traceback's last line and the run goes
on to the next group. ``--device cpu`` runs the same code with ``quick`` shapes, so no check can
rot unseen; comparisons whose two sides are then both CPU still exercise every code path.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

GROUPS = ("fp8", "models", "training", "serving", "checkpoints", "costmodel")


def _machine(device) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "host": platform.node(), "device": str(device), "commit": _commit()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=props.total_memory / 2**30, nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def _commit() -> str:
    if os.environ.get("RAYFLEET_COMMIT"):
        return os.environ["RAYFLEET_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _write(out: Path, ctx, machine: dict, started: float, groups_s: dict) -> Path:
    path = out / "gpu_check.json"
    doc = {"machine": machine, "quick": ctx.quick, "wall_s": time.monotonic() - started, "groups_s": groups_s,
           "counts": {s: sum(r.status == s for r in ctx.results) for s in ("pass", "fail", "info", "skip")},
           "results": [r.to_json() for r in ctx.results]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)
    return path


def _summary(ctx) -> str:
    lines = ["", "=== gpu_check summary ==="]
    for r in ctx.results:
        figs = ", ".join(f"{k}={_short(v)}" for k, v in r.figures.items() if not isinstance(v, (list, dict)))
        lines.append(f"{r.status.upper():4} {r.group}/{r.name}" + (f" — {r.detail}" if r.detail else "")
                     + (f" [{figs}]" if figs else ""))
    counts = {s: sum(r.status == s for r in ctx.results) for s in ("pass", "fail", "info", "skip")}
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['info']} measured, {counts['skip']} skipped")
    return "\n".join(lines)


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.json")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--only", default="", help=f"comma-separated groups of {','.join(GROUPS)}")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds the whole run may take; long checks shrink or skip as it runs out")
    args = parser.parse_args(argv)
    import torch

    from gpu_checks.context import Context

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch sees no CUDA device here; use --device cpu")
    groups = [g for g in args.only.split(",") if g] or list(GROUPS)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown group; choose from {','.join(GROUPS)}")
    if device.startswith("cuda"):
        device = "cuda:0"
        torch.cuda.set_device(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(device, quick=not device.startswith("cuda"), deadline_s=args.budget_s)
    machine = _machine(ctx.device)
    print(f"gpu_check on {machine.get('gpu', 'cpu')} (torch {machine['torch']}, CUDA {machine['cuda']}), "
          f"groups {','.join(groups)}", flush=True)
    started, groups_s = time.monotonic(), {}
    for group in groups:
        ctx.group = group
        t0 = time.monotonic()
        print(f"--- {group}", flush=True)
        try:
            importlib.import_module(f"gpu_checks.{group}").run(ctx)
        except Exception as exc:  # noqa: BLE001 - one group's crash must not lose the others' results
            traceback.print_exc()
            ctx.record("crashed", False, f"{type(exc).__name__}: {exc}"[:500])
        finally:
            if ctx.on_cuda:
                torch.cuda.empty_cache()
        groups_s[group] = time.monotonic() - t0
        _write(out, ctx, machine, started, groups_s)
    path = _write(out, ctx, machine, started, groups_s)
    print(_summary(ctx))
    print(f"results: {path} ({time.monotonic() - started:.1f} s)")
    return 1 if any(r.status == "fail" for r in ctx.results) else 0


if __name__ == "__main__":
    sys.exit(main())
