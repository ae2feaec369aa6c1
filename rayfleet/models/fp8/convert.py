"""Apply FP8 to a built model by swapping modules: the model itself has no FP8 branches.

Design decisions:
- An allowlist, not a denylist: only attention projections (``wq wk wv wo``), dense/shared FFN
  projections (``w1 w2 w3``) and grouped experts are converted. Everything else stays in high
  precision whatever a caller's filter says: token embeddings, the output head, routers (their
  top-k flips on tiny differences), norms, and attention softmax (inside SDPA, never a Linear).
  ``HIGH_PRECISION_PARTS`` names them; a unit test checks none of them ever sees FP8.
- Apply after building (meta or materialized) and before parallelization, as torchtitan does:
  the swapped modules keep the same parameters, so FSDP/TP wrap them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from rayfleet.errors import SpecError
from rayfleet.models.fp8.modules import Fp8GroupedExperts, Fp8Linear
from rayfleet.models.fp8.numerics import scaled_mm_fast
from rayfleet.models.fp8.recipes import Fp8Recipe, get_recipe
from rayfleet.models.moe import GroupedExperts

__all__ = ["FP8_LINEAR_NAMES", "HIGH_PRECISION_PARTS", "Fp8ConversionReport", "convert_to_fp8"]

FP8_LINEAR_NAMES = frozenset({"wq", "wk", "wv", "wo", "w1", "w2", "w3"})
HIGH_PRECISION_PARTS = frozenset({"tok_embeddings", "output", "norm", "attention_norm", "ffn_norm",
                                  "router"})


@dataclass(frozen=True)
class Fp8ConversionReport:
    recipe: str
    gemm: str  # "scaled_mm" (real FP8 GEMMs where layouts allow) or "emulated"
    converted: tuple[str, ...]


def _is_high_precision(fqn: str) -> bool:
    return any(part in HIGH_PRECISION_PARTS for part in fqn.split("."))


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | str, *, use_scaled_mm: bool | None = None,
                   module_filter: Callable[[str], bool] | None = None) -> Fp8ConversionReport:
    """Swap allowlisted GEMM modules of ``model`` (in place) for FP8 versions of ``recipe``.

    use_scaled_mm: None picks ``torch._scaled_mm`` when the device runs it at speed (``scaled_mm_fast``).
    module_filter: optional extra restriction on fully-qualified names (cannot widen the allowlist).
    """
    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    device = next(model.parameters()).device
    if use_scaled_mm is None:
        use_scaled_mm = device.type != "meta" and scaled_mm_fast(device.type)
    converted = []
    for fqn, module in list(model.named_modules()):
        if not fqn or _is_high_precision(fqn) or (module_filter is not None and not module_filter(fqn)):
            continue
        if isinstance(module, (Fp8Linear, Fp8GroupedExperts)):
            raise SpecError("model", fqn, "is already converted to FP8",
                            "convert a freshly built model once")
        if type(module) is nn.Linear and fqn.rsplit(".", 1)[-1] in FP8_LINEAR_NAMES:
            swapped: nn.Module = Fp8Linear.from_linear(module, recipe=recipe, use_scaled_mm=use_scaled_mm)
        elif type(module) is GroupedExperts:
            swapped = Fp8GroupedExperts.from_experts(module, recipe=recipe, use_scaled_mm=use_scaled_mm)
        else:
            continue
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, swapped)
        converted.append(fqn)
    return Fp8ConversionReport(recipe.name, "scaled_mm" if use_scaled_mm else "emulated", tuple(converted))
