"""The accelerator catalogue: the numbers every plan, cost and simulation speaks in.

Design decisions:
- One frozen record per accelerator type, with units in the field names (TFLOP/s, GiB, GB/s), so
  the cost model never guesses a unit. Link figures are *per accelerator, one direction*.
- NVIDIA figures are the vendors' published dense (no sparsity) SXM numbers. Kunlun P800 and
  Ascend 910B figures are from public reports and press material and are marked ``approximate``;
  they are good enough to rank plans, not to quote.
- ``ray_resource`` is the Ray resource name the accelerator is declared as ("GPU", Ray's native
  "NPU" for Ascend, a custom "XPU" for Kunlun), so mixed fleets schedule by type.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayfleet.errors import UnknownAcceleratorError

__all__ = ["AcceleratorSpec", "CATALOGUE", "get_accelerator", "accelerator_names"]


@dataclass(frozen=True)
class AcceleratorSpec:
    """One accelerator type.

    Attributes:
        name: catalogue key, also the value of the accelerator-type node label.
        vendor: who makes it.
        ray_resource: Ray resource name the accelerator is declared as.
        peak_bf16_tflops: dense BF16 peak, TFLOP/s.
        peak_fp8_tflops: dense FP8 peak, TFLOP/s; ``None`` when the part has no FP8 units.
        hbm_gib: device memory, GiB.
        hbm_bandwidth_gbps: device memory bandwidth, GB/s.
        intra_node_link_gbps: scale-up link (NVLink/HCCS/XPU link) per accelerator, one
            direction, GB/s.
        nic_gbps: scale-out network per accelerator (one NIC per rail), one direction, GB/s.
        accelerators_per_node: accelerators in one server.
        scaleup_domain_size: accelerators that share the scale-up link (NVLink domain or
            super-node); a multiple of ``accelerators_per_node``.
        approximate: True when the figures come from press reports rather than a datasheet.
    """

    name: str
    vendor: str
    ray_resource: str
    peak_bf16_tflops: float
    peak_fp8_tflops: float | None
    hbm_gib: float
    hbm_bandwidth_gbps: float
    intra_node_link_gbps: float
    nic_gbps: float
    accelerators_per_node: int
    scaleup_domain_size: int
    approximate: bool = False

    @property
    def supports_fp8(self) -> bool:
        return self.peak_fp8_tflops is not None

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for ``precision`` ("bf16" or "fp8*"); FP8 falls back to BF16 without units."""
        if precision.startswith("fp8") and self.peak_fp8_tflops is not None:
            return self.peak_fp8_tflops
        return self.peak_bf16_tflops


CATALOGUE: dict[str, AcceleratorSpec] = {
    spec.name: spec
    for spec in (
        AcceleratorSpec(
            name="H100", vendor="NVIDIA", ray_resource="GPU",
            peak_bf16_tflops=989.0, peak_fp8_tflops=1979.0,
            hbm_gib=80.0, hbm_bandwidth_gbps=3350.0,
            intra_node_link_gbps=450.0, nic_gbps=50.0,
            accelerators_per_node=8, scaleup_domain_size=8,
        ),
        AcceleratorSpec(
            name="H200", vendor="NVIDIA", ray_resource="GPU",
            peak_bf16_tflops=989.0, peak_fp8_tflops=1979.0,
            hbm_gib=141.0, hbm_bandwidth_gbps=4800.0,
            intra_node_link_gbps=450.0, nic_gbps=50.0,
            accelerators_per_node=8, scaleup_domain_size=8,
        ),
        AcceleratorSpec(
            name="A100", vendor="NVIDIA", ray_resource="GPU",
            peak_bf16_tflops=312.0, peak_fp8_tflops=None,
            hbm_gib=80.0, hbm_bandwidth_gbps=2039.0,
            intra_node_link_gbps=300.0, nic_gbps=25.0,
            accelerators_per_node=8, scaleup_domain_size=8,
        ),
        AcceleratorSpec(
            name="B200", vendor="NVIDIA", ray_resource="GPU",
            peak_bf16_tflops=2250.0, peak_fp8_tflops=4500.0,
            hbm_gib=180.0, hbm_bandwidth_gbps=8000.0,
            intra_node_link_gbps=900.0, nic_gbps=100.0,
            # GB200 NVL72: 18 compute trays of 4 GPUs share one NVLink domain.
            accelerators_per_node=4, scaleup_domain_size=72,
        ),
        AcceleratorSpec(
            name="P800", vendor="Kunlunxin", ray_resource="XPU",
            peak_bf16_tflops=345.0, peak_fp8_tflops=690.0,
            hbm_gib=96.0, hbm_bandwidth_gbps=2765.0,
            intra_node_link_gbps=200.0, nic_gbps=50.0,
            # 32-card super-node: four 8-card servers on one XPU-link fabric.
            accelerators_per_node=8, scaleup_domain_size=32,
            approximate=True,
        ),
        AcceleratorSpec(
            name="910B", vendor="Huawei Ascend", ray_resource="NPU",
            peak_bf16_tflops=313.0, peak_fp8_tflops=None,
            hbm_gib=64.0, hbm_bandwidth_gbps=1600.0,
            intra_node_link_gbps=196.0, nic_gbps=25.0,
            accelerators_per_node=8, scaleup_domain_size=8,
            approximate=True,
        ),
    )
}


def accelerator_names() -> list[str]:
    return sorted(CATALOGUE)


def get_accelerator(name: str) -> AcceleratorSpec:
    """Look up ``name`` (case-insensitive); raise a clear error for an unknown type."""
    for key, spec in CATALOGUE.items():
        if key.lower() == str(name).strip().lower():
            return spec
    raise UnknownAcceleratorError(
        f"accelerator type {name!r} is not in the catalogue. "
        f"Fix: use one of {', '.join(accelerator_names())} "
        "(or add an AcceleratorSpec to rayfleet/platform/catalogue.py)"
    )
