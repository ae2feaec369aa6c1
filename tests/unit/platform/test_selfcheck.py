import torch

from rayfleet.platform.selfcheck import expected_checksum, flip_one_bit, run_gemm_self_check


def test_healthy_check_is_exact_and_repeatable():
    first, second = run_gemm_self_check(), run_gemm_self_check()
    assert first.ok and second.ok and first.checksum == second.checksum == expected_checksum()


def test_checksum_is_independent_of_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_gemm_self_check().checksum
    finally:
        torch.set_num_threads(threads)
    assert single == expected_checksum()


def test_one_flipped_bit_is_caught():
    result = run_gemm_self_check(corrupt=flip_one_bit)
    assert not result.ok and result.checksum != result.expected and not result.repeatable


def test_different_seeds_give_different_checksums():
    assert expected_checksum(0) != expected_checksum(1)
