"""FP8 wire format: round trip, row-split invariance (all-to-all), size."""

from __future__ import annotations

import pytest
import torch

from rayfleet.errors import SpecError
from rayfleet.models.fp8 import (E5M2, TILE_1x128, dequantize, pack_fp8_rows, packed_row_bytes,
                                 quantize, unpack_fp8_rows)


@pytest.mark.parametrize("dim", [256, 200])
def test_round_trip_equals_quantize_dequantize(dim):
    x = torch.randn(33, dim, dtype=torch.bfloat16) * 3
    packed = pack_fp8_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (33, packed_row_bytes(dim))
    unpacked = unpack_fp8_rows(packed, dim=dim)
    reference, _ = quantize(x, block=TILE_1x128)
    assert torch.equal(dequantize(unpacked), dequantize(reference))
    err = float((dequantize(unpacked) - x.float()).norm() / x.float().norm())
    assert 0 < err < 0.04


def test_any_row_split_is_a_valid_packet():
    # all_to_all_single sends row ranges: slicing the packet must equal packing the slice.
    x = torch.randn(40, 256)
    packed = pack_fp8_rows(x)
    for start, end in [(0, 7), (7, 31), (31, 40)]:
        assert torch.equal(packed[start:end], pack_fp8_rows(x[start:end]))
    parts = [unpack_fp8_rows(packed[s:e], dim=256) for s, e in [(0, 13), (13, 40)]]
    whole = unpack_fp8_rows(packed, dim=256)
    assert torch.equal(torch.cat([dequantize(p) for p in parts]), dequantize(whole))


def test_wire_is_about_half_of_bf16_and_e5m2_works():
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    assert pack_fp8_rows(x).numel() / (x.numel() * x.element_size()) == pytest.approx((1 + 4 / 128) / 2)
    y = unpack_fp8_rows(pack_fp8_rows(x, dtype=E5M2), dim=1024, dtype=E5M2)
    assert y.data.dtype == E5M2


def test_wrong_dims_are_spec_errors():
    packed = pack_fp8_rows(torch.randn(4, 256))
    with pytest.raises(SpecError, match="dim=128"):
        unpack_fp8_rows(packed, dim=128)
    with pytest.raises(SpecError):
        pack_fp8_rows(torch.randn(2, 3, 4))


def test_packing_zero_rows_regression():
    # An EP rank that receives no tokens packs an empty batch; this crashed the demo's FP8
    # expert exchange ("stride(-1) must be 1 to view Float as Byte").
    from rayfleet.models.fp8.packing import pack_fp8_rows, packed_row_bytes, unpack_fp8_rows

    packed = pack_fp8_rows(torch.randn(0, 128))
    assert packed.shape == (0, packed_row_bytes(128)) and packed.dtype == torch.uint8
    back = unpack_fp8_rows(packed, dim=128)
    assert back.data.shape == (0, 128)
