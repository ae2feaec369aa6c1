"""FP8 drop-in modules that share their parameters with the modules they replace.

Design decisions:
- ``Fp8Linear`` subclasses ``nn.Linear`` and ``Fp8GroupedExperts`` subclasses
  ``GroupedExperts``, and both take over the original ``Parameter`` objects: state-dict keys,
  optimizer state, FSDP/TP sharding and checkpoints are the same with and without FP8.
- Only the GEMM changes; everything around it (SwiGLU, routing, combine) runs in the
  caller's precision.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from rayfleet.models.fp8.functional import DelayedScalingState, fp8_grouped_mm
from rayfleet.models.fp8.recipes import Fp8Recipe
from rayfleet.models.moe import GroupedExperts

__all__ = ["Fp8Linear", "Fp8GroupedExperts"]


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose matmul runs through ``fp8_grouped_mm`` (one group)."""

    recipe: Fp8Recipe
    use_scaled_mm: bool

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe: Fp8Recipe, use_scaled_mm: bool) -> "Fp8Linear":
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.bias = linear.bias
        module.recipe, module.use_scaled_mm = recipe, use_scaled_mm
        module.fp8_state = (DelayedScalingState(1, recipe.amax_history_len).to(linear.weight.device)
                            if recipe.scaling == "delayed" else None)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return self._forward_sharded(x)
        return self._gemm(x, self.weight)

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, weight.shape[1])
        out = fp8_grouped_mm(flat, weight.unsqueeze(0), [flat.shape[0]], recipe=self.recipe,
                             state=self.fp8_state, use_scaled_mm=self.use_scaled_mm)
        if self.bias is not None:
            bias = self.bias.to_local() if isinstance(self.bias, DTensor) else self.bias
            out = out + bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def _forward_sharded(self, x: torch.Tensor) -> torch.Tensor:
        """Tensor parallel: the FP8 GEMM runs on local shards (scales are per shard).

        A column-split weight (``Shard(0)``) gives a ``Shard(-1)`` output; a row-split weight
        (``Shard(1)``) a ``Partial`` one that the parallel style's output hook all-reduces.
        The quantizer works on plain tensors only, so DTensors are unwrapped around it.
        """
        weight = self.weight
        if weight.device_mesh.ndim != 1 or not isinstance(weight.placements[0], Shard) or self.bias is not None:
            raise NotImplementedError("Fp8Linear supports 1-D column/row tensor parallelism without bias")
        column = weight.placements[0].dim == 0
        # A column split's replicated input gets a partial gradient from each shard's GEMM: say
        # so, or to_local's backward takes it as replicated and the TP sum over shards is lost
        # (FP8 TP2 input gradients were missing the peer's half; a q-projection gradient 3x
        # further from FP32 than one FP8 process's, found by tests/unit/jobs/test_hf_parity_matrix.py).
        grad_placements = (Partial(),) if column and isinstance(x, DTensor) and x.placements[0].is_replicate() else None
        local_x = x.to_local(grad_placements=grad_placements) if isinstance(x, DTensor) else x
        out = self._gemm(local_x, weight.to_local())
        placement = Shard(out.dim() - 1) if column else Partial()
        return DTensor.from_local(out, weight.device_mesh, (placement,), run_check=False)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.recipe.name}"


class Fp8GroupedExperts(GroupedExperts):
    """Grouped experts whose three grouped GEMMs run in FP8 (per-expert weight scales)."""

    @classmethod
    def from_experts(cls, experts: GroupedExperts, *, recipe: Fp8Recipe,
                     use_scaled_mm: bool) -> "Fp8GroupedExperts":
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.num_experts = experts.num_experts
        module.w1, module.w2, module.w3 = experts.w1, experts.w2, experts.w3
        module.recipe, module.use_scaled_mm = recipe, use_scaled_mm
        module.fp8_state = (nn.ModuleDict({name: DelayedScalingState(experts.num_experts,
                                                                     recipe.amax_history_len)
                                           for name in ("w1", "w2", "w3")}).to(experts.w1.device)
                            if recipe.scaling == "delayed" else None)
        return module

    def linear(self, x: torch.Tensor, weight: torch.Tensor, sizes: list[int], name: str) -> torch.Tensor:
        state = None if self.fp8_state is None else self.fp8_state[name]
        return fp8_grouped_mm(x, weight, sizes, recipe=self.recipe, state=state,
                              use_scaled_mm=self.use_scaled_mm)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, fp8={self.recipe.name}"
