"""FP8 on the wire for all four expert exchanges: dispatch, combine and both backward exchanges.

Two real gloo ranks run the EP dispatcher over a known "expert" (``y = 2 x``) and a known
upstream gradient ``G``, so the exact results are computable on one rank:

    out[t]    = sum_k w_tk * 2 x_t                 (FP8 off)
    out[t]    = sum_k w_tk * q(2 q(x_t))           (FP8 on: dispatch, then combine quantized)
    x.grad[t] = sum_k 2 w_tk G_t                   (FP8 off)
    x.grad[t] = sum_k q(2 q(w_tk G_t))             (FP8 on: both backward exchanges quantized)

with ``q`` = pack to E4M3 1x128 tiles and back. Each mode must match its own formula tightly and
miss the other's: the FP8 checks fail when any one of the four exchanges is not FP8 (the
combine and backward ones were not, before issue 19).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


def _rank_main(out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from rayfleet.jobs.local_processes import leave_after_barrier
    from rayfleet.models.expert_parallel import ExpertParallelDispatcher, _from_wire, _to_wire

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def q(rows: torch.Tensor) -> torch.Tensor:
        return _from_wire(_to_wire(rows, True), fp8=True, dim=rows.shape[1], dtype=rows.dtype)

    gen = torch.Generator().manual_seed(100 + rank)
    tokens, dim, experts, top_k = 12, 256, 4, 2
    x0 = torch.randn(tokens, dim, generator=gen) * 3
    idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    upstream = torch.randn(tokens, dim, generator=gen)
    result = {}
    for fp8 in (False, True):
        x = x0.clone().requires_grad_(True)
        dispatcher = ExpertParallelDispatcher(group=dist.group.WORLD, ep_size=2, fp8=fp8)
        dispatched = dispatcher.dispatch(x, idx, w, num_experts=experts, capacity=None)
        out = dispatcher.combine(dispatched.tokens * 2.0, dispatched)
        (out * upstream).sum().backward()
        exact_out = 2 * x0 * w.sum(1, keepdim=True)
        exact_grad = 2 * upstream * w.sum(1, keepdim=True)
        fp8_out = sum(w[:, k:k + 1] * q(2 * q(x0)) for k in range(top_k))
        fp8_grad = sum(q(2 * q(w[:, k:k + 1] * upstream)) for k in range(top_k))

        def gap(a, b):
            return float(((a - b).abs().max() / b.abs().max()))

        result["fp8" if fp8 else "exact"] = {
            "out_vs_exact": gap(out.detach(), exact_out), "out_vs_fp8": gap(out.detach(), fp8_out),
            "grad_vs_exact": gap(x.grad, exact_grad), "grad_vs_fp8": gap(x.grad, fp8_grad)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    leave_after_barrier()


@pytest.fixture(scope="module")
def gaps(tmp_path_factory) -> list[dict]:
    from rayfleet.jobs.local_processes import run_script_ranks

    out = tmp_path_factory.mktemp("fp8wire")
    run_script_ranks(str(HERE), [str(out)], 2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


TIGHT, QUANTIZED = 1e-5, 1e-3  # float summation order vs. the E4M3 rounding (~2-6% per element)


def test_fp8_wire_quantizes_dispatch_and_combine_forward(gaps) -> None:
    for rank in gaps:
        assert rank["fp8"]["out_vs_fp8"] < TIGHT, rank
        assert rank["fp8"]["out_vs_exact"] > QUANTIZED, rank  # it really travelled in FP8


def test_fp8_wire_quantizes_both_backward_exchanges(gaps) -> None:
    for rank in gaps:
        assert rank["fp8"]["grad_vs_fp8"] < TIGHT, rank
        assert rank["fp8"]["grad_vs_exact"] > QUANTIZED, rank


def test_with_fp8_off_the_exchanges_are_exact_and_the_fp8_checks_would_fail(gaps) -> None:
    for rank in gaps:
        assert rank["exact"]["out_vs_exact"] < TIGHT and rank["exact"]["grad_vs_exact"] < TIGHT, rank
        assert rank["exact"]["out_vs_fp8"] > QUANTIZED and rank["exact"]["grad_vs_fp8"] > QUANTIZED, rank


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _rank_main(sys.argv[1])
