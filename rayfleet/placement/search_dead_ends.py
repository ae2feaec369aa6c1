"""Why a plan search found no shape at all: which divisibility, layer or size constraint ruled
out each (tp, cp, ep, etp) x pp x dp, and the nearest sizes that have a shape.

Design decisions:
- Called only when the candidate enumeration (:func:`rayfleet.placement.planner._candidates`)
  produced nothing -- not even a shape rejected for memory -- so the common path pays nothing.
- It walks the same core shapes and applies the same rules as
  :mod:`rayfleet.placement.search_space` (``tp | domain`` and heads, ``pp <= min(layers, max_pp)``,
  ``dp | batch / smallest micro-batch``, ``ep * etp | tp * cp * dp``), but keeps the first rule
  each shape breaks instead of skipping it. One :class:`Rejection` per shape; the table groups
  them by the word before the colon (``size``, ``layers``, ``batch``, ``experts``).
- The fix a user most often needs is a size that works: :func:`nearest_sizes` lists the plan
  sizes just below and above the one asked for.
"""

from __future__ import annotations

from rayfleet.placement.model_spec import ModelSpec
from rayfleet.placement.search_results import Rejection
from rayfleet.placement.search_space import CoreShape, SearchSpace, core_shapes, divisors

__all__ = ["size_dead_ends", "nearest_sizes"]


def _label(core: CoreShape, pp: int | None = None, dp: int | None = None) -> str:
    mid = (f" PP{pp}" if pp is not None else "") + (f" DP{dp}" if dp is not None else "")
    return f"TP{core.tp} CP{core.cp}{mid} EP{core.ep} ETP{core.etp}"


def nearest_sizes(model: ModelSpec, domain: int, space: SearchSpace, target: int) -> tuple[int | None, int | None]:
    """(largest size < ``target``, smallest size > ``target``) that some shape takes exactly."""
    top = min(model.num_layers, space.max_pp)
    batch = model.global_batch_sequences // min(space.micro_batch_sizes)
    below: int | None = None
    above: int | None = None
    for core in core_shapes(model, domain, space):
        for pp in range(1, top + 1):
            for dp in divisors(batch):
                if (core.tp * core.cp * dp) % (core.ep * core.etp):
                    continue
                n = core.tp * core.cp * pp * dp
                if n < target and (below is None or n > below):
                    below = n
                elif n > target and (above is None or n < above):
                    above = n
    return below, above


def size_dead_ends(model: ModelSpec, domain: int, lo: int, hi: int, space: SearchSpace) -> list[Rejection]:
    """One rejection per shape that no size in ``[lo, hi]`` allows, naming the rule it breaks
    and the setting that fixes it (empty when some shape exists)."""
    top = min(model.num_layers, space.max_pp)
    mbs = min(space.micro_batch_sizes)
    gbs = model.global_batch_sequences
    batch = gbs // mbs if gbs % mbs == 0 else 0
    dps = set(divisors(batch)) if batch else set()
    near = nearest_sizes(model, domain, space, lo) if lo == hi else (None, None)
    sizes = " or ".join(f"{n:,}" for n in near if n is not None)
    size_fix = f"Fix: ask for {sizes} accelerators (--exact), or let the planner choose the size" if sizes else \
        "Fix: let the planner choose the size"
    out: list[Rejection] = []
    for core in core_shapes(model, domain, space):
        width = core.tp * core.cp
        if lo == hi and lo % width:
            out.append(Rejection(_label(core), f"size: {lo:,} accelerators is not a multiple of TP*CP = {width}. "
                                 + size_fix))
            continue
        pps = divisors(lo // width) if lo == hi else range(1, top + 1)
        for pp in pps:
            if pp > top:
                out.append(Rejection(_label(core, pp), f"layers: PP{pp} (= {lo:,} / TP*CP*DP for every DP that "
                                     f"divides the batch) exceeds {top} stages (num_layers={model.num_layers}, "
                                     f"max_pp={space.max_pp}). " + size_fix))
                continue
            if lo != hi:
                fitting = [d for d in sorted(dps) if lo <= width * pp * d <= hi]
                if not fitting:
                    out.append(Rejection(_label(core, pp), f"size: no DP degree that divides the batch ({batch} "
                                         f"micro-batches of {mbs}) puts TP*CP*PP*DP = {width * pp}*DP within "
                                         f"[{lo:,}, {hi:,}]. Fix: widen --max-accelerators / min_accelerators"))
                    continue
                dp_options = fitting
            else:
                dp_options = [lo // (width * pp)]
            for dp in dp_options:
                if dp not in dps:
                    out.append(Rejection(_label(core, pp, dp), f"batch: DP{dp} does not divide the global batch "
                                         f"of {gbs} sequences at micro-batch {mbs} ({batch} micro-batches). Fix: "
                                         "set global_batch_sequences to a multiple of the DP degree, or " + size_fix[5:]))
                elif (width * dp) % (core.ep * core.etp):
                    out.append(Rejection(_label(core, pp, dp), f"experts: EP*ETP = {core.ep * core.etp} does not "
                                         f"divide TP*CP*DP = {width * dp} (the ranks of one stage). "
                                         "Fix: a size with more DP, or fewer experts per group"))
                else:
                    return []  # a shape exists: the search's own rejections explain the rest
    return out
