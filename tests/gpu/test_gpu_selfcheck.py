"""On a real GPU the self-check must give the same exact checksum as on CPU (TF32 off)."""

import pytest
import torch

from rayfleet.platform.selfcheck import expected_checksum, run_gemm_self_check

pytestmark = pytest.mark.gpu


def test_gpu_self_check_matches_cpu_ground_truth():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would round the integer products
    try:
        result = run_gemm_self_check(device="cuda:0")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert result.ok and result.checksum == expected_checksum()
