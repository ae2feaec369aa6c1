"""The accelerator catalogue: the numbers every plan, cost and simulation speaks in.

Design decisions:
- One frozen record per accelerator type, with units in the field names (TFLOP/s, GiB, GB/s), so
  the cost model never guesses a unit. Link figures are *per accelerator, one direction*.
- NVIDIA and AMD figures are the vendors' published dense (no sparsity) numbers, cited per entry.
  Datasheets quote link bandwidth both directions together; the catalogue stores half. HBM is
  the datasheet's GB figure used as GiB (a 7% optimistic rounding every entry shares, so plans
  rank alike). Kunlun P800, Ascend 910B and H20 figures are from public reports and press
  material and are marked ``approximate``; they are good enough to rank plans, not to quote.
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
        # NVIDIA H800 SXM5 (China export variant of H100): H100 SXM compute and memory, NVLink
        # cut to 400 GB/s both directions (NVIDIA H800 datasheet; DeepSeek-V3 report sec. 3.1:
        # 8 GPUs per node on NVLink/NVSwitch, 400 Gb/s InfiniBand per GPU).
        AcceleratorSpec(
            name="H800", vendor="NVIDIA", ray_resource="GPU",
            peak_bf16_tflops=989.0, peak_fp8_tflops=1979.0,
            hbm_gib=80.0, hbm_bandwidth_gbps=3350.0,
            intra_node_link_gbps=200.0, nic_gbps=50.0,
            accelerators_per_node=8, scaleup_domain_size=8,
        ),
        # NVIDIA HGX H20 (China export variant): 148 TFLOP/s BF16 / 296 FP8 dense, 96 GB HBM3 at
        # 4.0 TB/s, NVLink 900 GB/s both directions -- NVIDIA's partner spec sheet as reported
        # publicly (no public datasheet on nvidia.com), hence approximate; 400 Gb/s NIC per GPU.
        AcceleratorSpec(
            name="H20", vendor="NVIDIA", ray_resource="GPU",
            peak_bf16_tflops=148.0, peak_fp8_tflops=296.0,
            hbm_gib=96.0, hbm_bandwidth_gbps=4000.0,
            intra_node_link_gbps=450.0, nic_gbps=50.0,
            accelerators_per_node=8, scaleup_domain_size=8,
            approximate=True,
        ),
        # NVIDIA HGX/DGX B200: per GPU 2.25 PFLOP/s BF16 and 4.5 FP8 dense (half the sparse
        # figures of the HGX B200 spec table), 180 GB HBM3e (DGX B200: 1,440 GB, 64 TB/s for 8),
        # NVLink 5 at 1.8 TB/s both directions, 8 GPUs per NVLink domain, one 400 Gb/s
        # ConnectX-7 per GPU (DGX B200 datasheet).
        AcceleratorSpec(
            name="B200", vendor="NVIDIA", ray_resource="GPU",
            peak_bf16_tflops=2250.0, peak_fp8_tflops=4500.0,
            hbm_gib=180.0, hbm_bandwidth_gbps=8000.0,
            intra_node_link_gbps=900.0, nic_gbps=50.0,
            accelerators_per_node=8, scaleup_domain_size=8,
        ),
        # NVIDIA GB200 NVL72: 72 Blackwell GPUs in one NVLink domain (18 compute trays of 4);
        # per GPU 2.5 PFLOP/s BF16 and 5 FP8 dense (rack: 180 / 360 PFLOP/s dense of the 360 /
        # 720 sparse on the GB200 NVL72 page), ~186 GB HBM3e (13.4 TB / 72) at 8 TB/s, NVLink 5
        # 1.8 TB/s both directions; 800 Gb/s scale-out per GPU assumed (ConnectX-8 trays).
        AcceleratorSpec(
            name="GB200", vendor="NVIDIA", ray_resource="GPU",
            peak_bf16_tflops=2500.0, peak_fp8_tflops=5000.0,
            hbm_gib=186.0, hbm_bandwidth_gbps=8000.0,
            intra_node_link_gbps=900.0, nic_gbps=100.0,
            accelerators_per_node=4, scaleup_domain_size=72,
        ),
        # AMD Instinct MI300X (OAM): 1307.4 TFLOP/s BF16 and 2614.9 FP8 dense, 192 GB HBM3 at
        # 5.3 TB/s (AMD MI300X datasheet); 7 Infinity Fabric links of 128 GB/s both directions
        # to the 7 peers of an 8-GPU platform (896 GB/s aggregate: 448 one way -- all-to-all
        # sees it, a ring only its two neighbours' links); one 400 Gb/s NIC per GPU.
        AcceleratorSpec(
            name="MI300X", vendor="AMD", ray_resource="GPU",
            peak_bf16_tflops=1307.4, peak_fp8_tflops=2614.9,
            hbm_gib=192.0, hbm_bandwidth_gbps=5300.0,
            intra_node_link_gbps=448.0, nic_gbps=50.0,
            accelerators_per_node=8, scaleup_domain_size=8,
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
