"""Catalogue entries: the spec-sheet relations every entry must keep (units, per-direction links)."""

from __future__ import annotations

import pytest

from rayfleet.platform.catalogue import CATALOGUE, get_accelerator


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_entries_are_consistent(name: str) -> None:
    spec = CATALOGUE[name]
    assert spec.scaleup_domain_size % spec.accelerators_per_node == 0
    assert spec.peak_fp8_tflops is None or spec.peak_fp8_tflops == pytest.approx(2 * spec.peak_bf16_tflops, rel=0.01)
    # per direction: no scale-out NIC beats the scale-up link, no link reaches HBM bandwidth
    assert spec.nic_gbps < spec.intra_node_link_gbps < spec.hbm_bandwidth_gbps


def test_export_and_new_parts_keep_their_published_differences() -> None:
    h100, h800, h20 = get_accelerator("H100"), get_accelerator("H800"), get_accelerator("H20")
    assert h800.peak_bf16_tflops == h100.peak_bf16_tflops and h800.intra_node_link_gbps == 200.0  # 400 GB/s both ways
    assert h20.peak_bf16_tflops == 148.0 and h20.hbm_gib == 96.0 and h20.approximate
    b200, gb200 = get_accelerator("B200"), get_accelerator("GB200")
    assert (b200.scaleup_domain_size, gb200.scaleup_domain_size) == (8, 72)
    mi300x = get_accelerator("mi300x")
    assert mi300x.vendor == "AMD" and mi300x.hbm_gib == 192.0 and mi300x.peak_bf16_tflops == pytest.approx(1307.4)
