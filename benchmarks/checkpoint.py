"""Flash checkpoint cost: how long a snapshot blocks a train step, against a synchronous save.

For model states of 0.25, 0.5, 1 and 2 GiB (dicts of fp32 tensors, 64 MiB each), in one run:
- the step-blocking time of ``FlashCheckpointer.after_step`` (the copy into pre-touched shared
  memory; CRC + commit run in the background), cold (first call: maps and touches the slots)
  and warm (median of the following calls), per GiB. Goal: warm <= 0.1 s/GiB;
- the baseline measured beside it: ``torch.save`` to local disk + fsync, per GiB; goal: the
  warm snapshot blocks >= 10x less;
- the memory-bandwidth floor: the same bytes copied between ordinary pre-touched tensors;
- the background persist of a snapshot to storage (the checkpoint store: DCP + CRC manifest,
  fsync'd) — it does not block the step, shown for scale;
- restore time from shared memory (CRC verify + copy into the model's tensors) vs from storage
  (``load_checkpoint`` into the same tensors). The storage files were just written, so they are
  read from the page cache: the storage figure is a lower bound for a real restart.

Sizes are capped to what fits: /dev/shm must hold two slots per size and the machine's available
memory the state, the slots and some slack (other people share this machine). Memory is freed
between sizes. Writes benchmarks/results/checkpoint.json (``--json``); prints the table last.

    python benchmarks/checkpoint.py            # 0.25, 0.5, 1, 2 GiB (~1-2 min here)
    python benchmarks/checkpoint.py --quick    # 64 and 128 MiB, 3 warm snapshots each (seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import Goal, Table, cpu_name, record_run  # benchmarks/common.py (this script's directory is on sys.path)
from rayfleet.jobs.checkpoint.flash import CheckpointState, FlashCheckpointer
from rayfleet.platform.snapshot import SnapshotStore

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1 << 30
TENSOR_BYTES = 64 << 20


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def make_state(num_bytes: int) -> dict[str, torch.Tensor]:
    numel = TENSOR_BYTES // 4
    state = {}
    for i in range(max(1, num_bytes // TENSOR_BYTES)):
        state[f"layers.{i}.weight"] = torch.full((numel,), float(i), dtype=torch.float32)  # touched pages
    return state


def sync_save_s(state: dict, directory: Path) -> float:
    path = directory / "baseline.pt"
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def memcpy_floor_s(state: dict, repeats: int) -> float:
    """Median time to copy the state into pre-touched ordinary memory: the bandwidth floor."""
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for k, v in state.items():
            targets[k].copy_(v)
        samples.append(time.perf_counter() - start)
    del targets
    return statistics.median(samples)


def run_size(size_gib: float, *, shm_root: str, disk_dir: Path, repeats: int) -> dict:
    state = make_state(int(size_gib * GIB))
    num_bytes = sum(t.numel() * 4 for t in state.values())
    gib = num_bytes / GIB
    job = f"bench-{os.getpid()}-{size_gib}"
    ckpt_uri = str(disk_dir / f"ckpt-{size_gib}")
    store = SnapshotStore(shm_root, job=job, rank=0)
    ckpt = FlashCheckpointer(snapshot_every=1, persist_every=10**9, store=store, checkpoint_uri=ckpt_uri, keep=1)
    fn = lambda: CheckpointState(sharded={"model": state}, rank_local={"step": 0})  # noqa: E731
    try:
        events = []
        for step in range(1, repeats + 2):
            events.append(ckpt.after_step(step, fn))
            ckpt._wait_commit()  # a real step runs here; keep the background commit out of the next timing
        cold, warm = events[0], [e.blocking_s for e in events[1:]]
        baseline = [sync_save_s(state, disk_dir) for _ in range(max(1, repeats // 2))]
        floor_s = memcpy_floor_s(state, repeats)
        start = time.perf_counter()
        ckpt.flush()  # the same persist the background thread runs, timed here
        persist_s = time.perf_counter() - start
        ckpt.close()

        # Restore targets exist (and are touched) in a real job: the model was just built.
        template = CheckpointState(sharded={"model": {k: torch.zeros_like(v) for k, v in state.items()}})
        reader = FlashCheckpointer(snapshot_every=1, persist_every=1, store=SnapshotStore(shm_root, job=job, rank=0),
                                   checkpoint_uri=ckpt_uri)
        start = time.perf_counter()
        from_shm = reader.restore(template, prefer="shm")
        restore_shm_s = time.perf_counter() - start
        assert from_shm.source == "shm" and torch.equal(template.sharded["model"]["layers.0.weight"],
                                                        state["layers.0.weight"])
        for t in template.sharded["model"].values():
            t.zero_()
        start = time.perf_counter()
        from_storage = reader.restore(template, prefer="storage")
        restore_storage_s = time.perf_counter() - start
        last = f"layers.{len(state) - 1}.weight"
        assert from_storage.source == "storage" and torch.equal(template.sharded["model"][last], state[last])
        reader.close()
        warm_s = statistics.median(warm)
        save_s = statistics.median(baseline)
        return {
            "size_gib": round(gib, 3), "cold_snapshot_s": cold.blocking_s, "warm_snapshot_s": warm_s,
            "warm_snapshot_s_per_gib": warm_s / gib, "warm_snapshot_min_s_per_gib": min(warm) / gib,
            "warm_snapshot_samples_s": warm,
            "sync_save_s": save_s, "sync_save_s_per_gib": save_s / gib, "sync_save_samples_s": baseline,
            "blocking_ratio": save_s / warm_s, "persist_s": persist_s,
            "memcpy_floor_s_per_gib": floor_s / gib,
            "restore_shm_s": restore_shm_s, "restore_storage_s": restore_storage_s,
        }
    finally:
        store.destroy()
        shutil.rmtree(ckpt_uri, ignore_errors=True)
        del state
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 and 128 MiB, 3 warm snapshots each (a pipeline check)")
    parser.add_argument("--sizes", type=float, nargs="*", help="state sizes in GiB")
    parser.add_argument("--repeats", type=int, default=None, help="warm snapshots per size (default 5; quick 3)")
    parser.add_argument("--shm-root", default="/dev/shm/rayfleet-bench")
    parser.add_argument("--disk-dir", default=None, help="local disk directory for saves (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=RESULTS / "checkpoint.json", help="where the results go")
    args = parser.parse_args()
    sizes = args.sizes or ([0.0625, 0.125] if args.quick else [0.25, 0.5, 1.0, 2.0])
    args.repeats = args.repeats or (3 if args.quick else 5)

    shm = shutil.disk_usage("/dev/shm")
    available = mem_available_bytes()
    fits, skipped = [], []
    for size in sizes:
        # two shm slots + the live state + slack; /dev/shm pages count against RAM too
        if 2.2 * size * GIB <= shm.free and 3.5 * size * GIB <= 0.8 * available:
            fits.append(size)
        else:
            skipped.append(size)
    RESULTS.mkdir(parents=True, exist_ok=True)
    disk_dir = Path(args.disk_dir or tempfile.mkdtemp(prefix="ckpt-bench-", dir=str(RESULTS)))
    disk_dir.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(), "shm_free_gib": round(shm.free / GIB, 1),
               "mem_available_gib": round(available / GIB, 1), "disk_dir": str(disk_dir),
               "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    print(f"machine: {machine}")
    if skipped:
        print(f"skipped sizes (do not fit /dev/shm or available memory now): {skipped}")
    rows = []
    try:
        for size in fits:
            row = run_size(size, shm_root=args.shm_root, disk_dir=disk_dir, repeats=args.repeats)
            rows.append(row)
            print(f"  {size} GiB done: warm snapshot {row['warm_snapshot_s_per_gib']:.3f} s/GiB", flush=True)
    finally:
        if not args.disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)
        shutil.rmtree(args.shm_root, ignore_errors=True)

    out = args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "skipped_sizes": skipped, "rows": rows,
                               "goals": {"warm_snapshot_s_per_gib": 0.1, "blocking_ratio": 10}}, indent=1))
    print(f"wrote {out}")
    print("\nflash snapshot (step-blocking) vs synchronous torch.save + fsync; restore shm vs storage")
    print(f"ran on {machine['cpu']} ({machine['cpus']} cpus, torch {machine['torch']}), "
          f"load average {machine['load_avg_1m_at_start']} at start (shared machine: medians of {args.repeats})")
    header = (f"{'GiB':>5} {'cold s':>7} {'warm s':>7} {'warm s/GiB':>10} {'min s/GiB':>9} {'memcpy s/GiB':>12} {'save s/GiB':>10} "
              f"{'less blocking':>13} {'persist s':>9} {'restore shm s':>13} {'restore storage s':>17}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['size_gib']:>5.2f} {r['cold_snapshot_s']:>7.3f} {r['warm_snapshot_s']:>7.3f} "
              f"{r['warm_snapshot_s_per_gib']:>10.3f} {r['warm_snapshot_min_s_per_gib']:>9.3f} "
              f"{r['memcpy_floor_s_per_gib']:>12.3f} "
              f"{r['sync_save_s_per_gib']:>10.3f} "
              f"{r['blocking_ratio']:>12.1f}x {r['persist_s']:>9.2f} {r['restore_shm_s']:>13.3f} "
              f"{r['restore_storage_s']:>17.3f}")
    print("goals: warm snapshot <= 0.100 s/GiB, >= 10x less blocking than the synchronous save "
          "(less blocking = save median / warm snapshot median); storage restores read the page cache")
    goals = []
    for r in rows:
        goals += [Goal(f"{r['size_gib']:g} GiB: warm snapshot s/GiB", "<=", 0.1, r["warm_snapshot_s_per_gib"]),
                  Goal(f"{r['size_gib']:g} GiB: save / warm snapshot (less blocking)", ">=", 10, r["blocking_ratio"])]
    table = Table(["GiB", "cold s", "warm s", "warm s/GiB", "min s/GiB", "memcpy s/GiB", "save s/GiB", "less blocking",
                   "persist s", "restore shm s", "restore storage s"],
                  [[f"{r['size_gib']:.2f}", f"{r['cold_snapshot_s']:.3f}", f"{r['warm_snapshot_s']:.3f}",
                    f"{r['warm_snapshot_s_per_gib']:.3f}", f"{r['warm_snapshot_min_s_per_gib']:.3f}",
                    f"{r['memcpy_floor_s_per_gib']:.3f}", f"{r['sync_save_s_per_gib']:.3f}", f"{r['blocking_ratio']:.1f}x",
                    f"{r['persist_s']:.2f}", f"{r['restore_shm_s']:.3f}", f"{r['restore_storage_s']:.3f}"] for r in rows],
                  note=f"medians of {args.repeats}; skipped sizes: {skipped or 'none'}")
    record_run(name="checkpoint", quick=args.quick, params={"sizes_gib": sizes, "repeats": args.repeats},
               figures={"rows": rows, "skipped_sizes": skipped}, goals=goals, tables={"flash_snapshot": table})


if __name__ == "__main__":
    main()
