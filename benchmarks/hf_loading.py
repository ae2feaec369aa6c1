"""Loading a Hugging Face checkpoint per rank: time and peak memory against a full load.

In one run:
- writes a random Qwen3-MoE-shaped checkpoint (bf16 safetensors, sharded with an index, through
  ``rayfleet model export``'s writer): ~1.6 GiB by default, ~20 MiB with ``--quick``;
- baseline: one process loads the whole model through the same lazy reader
  (``rayfleet.storage.safetensors_io.HFCheckpoint`` + ``rayfleet.models.hf.load_hf_weights``),
  and one loads it with ``safetensors.torch.load_file`` (the reference library, every shard; it
  maps the files, so the benchmark touches every page to make it actually read them);
- the product path: 4 rank processes at once, each loading only its slice for EP = TP = 4
  (``rayfleet.models.hf.sharding.layout_shard_fn``: a quarter of the experts of every MoE layer,
  Megatron row/column quarters of attention and the output head, the rest replicated).
Each process reports the load's wall time and its peak RSS during the load (``VmHWM`` after
resetting it through ``/proc/self/clear_refs`` once imports are done), also net of the RSS it
had before the load. Goal: the per-rank net peak <= 1/2 of the full load's. The checkpoint was
just written, so reads come from the page cache: times are a lower bound for a cold disk.

    python benchmarks/hf_loading.py            # ~1.6 GiB checkpoint (~1-2 min here)
    python benchmarks/hf_loading.py --quick    # ~20 MiB (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 4


def hf_config(quick: bool) -> dict:
    big = dict(hidden_size=1024, num_hidden_layers=7, num_attention_heads=16, num_key_value_heads=4,
               head_dim=64, num_experts=64, moe_intermediate_size=512, vocab_size=32000, intermediate_size=2048)
    small = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=32, num_experts=16, moe_intermediate_size=128, vocab_size=8000, intermediate_size=512)
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts_per_tok": 4,
            "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
            **(small if quick else big)}


def write_checkpoint(folder: Path, config: dict) -> int:
    """A random bf16 checkpoint of ``config`` at ``folder``; returns its tensor bytes."""
    import torch

    from rayfleet.models import build_model
    from rayfleet.models.hf import export_hf_weights, from_hf_config
    from rayfleet.storage.safetensors_io import write_files, write_safetensors_shards

    spec = from_hf_config(config)
    shapes = {k: v.shape for k, v in build_model(spec.config, device="meta").state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    for k in state:
        if k.endswith("expert_bias"):
            state[k] = torch.zeros(state[k].shape)
    tensors, _ = export_hf_weights(spec, state)
    del state
    write_safetensors_shards(str(folder), tensors, max_shard_bytes=256 << 20)
    write_files(str(folder), {"config.json": json.dumps(config)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak is the load's, not the imports'."""
    Path("/proc/self/clear_refs").write_text("5")


def worker(folder: str, mode: str, rank: int) -> dict:
    """One process's load; the figures it prints on its last line are what the parent keeps."""
    import torch
    from safetensors.torch import load_file

    from rayfleet.models.hf import from_hf_config, load_hf_weights
    from rayfleet.models.hf.sharding import layout_shard_fn
    from rayfleet.storage.safetensors_io import HFCheckpoint

    torch.set_num_threads(1)
    _reset_peak_rss()
    base_kib = _status_kib("VmRSS")
    start = time.perf_counter()
    if mode == "load_file":
        state = {}
        for shard in sorted(Path(folder).glob("*.safetensors")):
            state.update(load_file(str(shard)))
        # load_file maps the file: touch one byte per page so the data is read and resident
        # (otherwise its time and RSS would leave out the reading).
        touched = sum(int(t.reshape(-1).view(torch.uint8)[::4096].sum()) for t in state.values() if t.numel())
        assert touched >= 0
    else:
        ckpt = HFCheckpoint(folder)
        spec = from_hf_config(ckpt.config)
        shard = layout_shard_fn(spec.config, tp_rank=rank, tp=WORLD, ep_rank=rank, ep=WORLD) if mode == "rank" else None
        state = load_hf_weights(spec, ckpt, shard=shard)
    seconds = time.perf_counter() - start
    held = sum(t.numel() * t.element_size() for t in state.values())
    peak_kib = _status_kib("VmHWM")
    return {"mode": mode, "rank": rank, "seconds": seconds, "held_bytes": held,
            "peak_rss_mib": peak_kib / 1024, "net_peak_mib": (peak_kib - base_kib) / 1024}


def _spawn(folder: Path, mode: str, rank: int) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", str(folder), "--mode", mode, "--rank", str(rank)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _collect(procs: list[subprocess.Popen]) -> list[dict]:
    rows = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a loader process failed (exit {p.returncode})")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a ~20 MiB checkpoint")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=RESULTS / "hf_loading.json", help="where the results go")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.mode, args.rank)))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import Goal, Table, cpu_name, record_run

    folder = Path(args.dir or tempfile.mkdtemp(prefix="hf-loading-"))
    try:
        t0 = time.perf_counter()
        total = write_checkpoint(folder, hf_config(args.quick))
        write_s = time.perf_counter() - t0
        print(f"wrote {total / 2**30:.2f} GiB random Qwen3-MoE checkpoint in {write_s:.1f}s at {folder}", flush=True)
        full = _collect([_spawn(folder, "full", 0)])[0]
        ref = _collect([_spawn(folder, "load_file", 0)])[0]
        ranks = _collect([_spawn(folder, "rank", r) for r in range(WORLD)])
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    machine = {"cpu": cpu_name(), "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    worst = max(r["net_peak_mib"] for r in ranks)
    result = {"machine": machine, "checkpoint_bytes": total, "full": full, "safetensors_load_file": ref,
              "ranks": ranks, "worst_rank_net_peak_over_full": worst / full["net_peak_mib"],
              "goal_worst_rank_net_peak_over_full": 0.5}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    print(f"\nHF checkpoint loading, EP = TP = {WORLD} ranks vs full loads "
          f"({total / 2**30:.2f} GiB bf16; {machine['cpu']}, {machine['cpus']} cpus, load {machine['load_avg_1m']})")
    header = f"{'loader':<28} {'seconds':>8} {'held MiB':>9} {'peak RSS MiB':>12} {'net peak MiB':>12} {'net vs full':>11}"
    print(header)
    print("-" * len(header))
    table_rows = []
    for label, r in [("full (lazy reader)", full), ("full (safetensors load_file)", ref),
                     *[(f"rank {r['rank']} of {WORLD} (EP/TP slice)", r) for r in ranks]]:
        print(f"{label:<28} {r['seconds']:>8.2f} {r['held_bytes'] / 2**20:>9.0f} {r['peak_rss_mib']:>12.0f} "
              f"{r['net_peak_mib']:>12.0f} {r['net_peak_mib'] / full['net_peak_mib']:>11.2f}")
        table_rows.append([label, f"{r['seconds']:.2f}", f"{r['held_bytes'] / 2**20:.0f}", f"{r['peak_rss_mib']:.0f}",
                           f"{r['net_peak_mib']:.0f}", f"{r['net_peak_mib'] / full['net_peak_mib']:.2f}"])
    verdict = "meets" if worst <= 0.5 * full["net_peak_mib"] else "misses"
    print(f"worst rank net peak / full = {worst / full['net_peak_mib']:.2f} ({verdict} the goal <= 0.50)")
    record_run(name="hf_loading", quick=args.quick, params={"world": WORLD, "checkpoint_bytes": total},
               figures={k: v for k, v in result.items() if k != "machine"},
               goals=[Goal("worst rank net peak memory / full load", "<=", 0.5, worst / full["net_peak_mib"])],
               tables={"loading": Table(["loader", "seconds", "held MiB", "peak RSS MiB", "net peak MiB", "net vs full"],
                                        table_rows, note=f"{total / 2**30:.2f} GiB bf16 Qwen3-MoE, EP = TP = {WORLD}")})


if __name__ == "__main__":
    main()
