"""poll_delays: fast first, then capped (the Serve shell's waits on replica starts)."""

from __future__ import annotations

import itertools

import pytest

from rayfleet.platform.polling import poll_delays


def test_delays_start_fast_grow_and_stop_growing_at_the_cap():
    delays = list(itertools.islice(poll_delays(0.25, 2.0, 1.5), 10))
    assert delays[0] == 0.25 and delays[1] == 0.375
    assert all(b >= a for a, b in zip(delays, delays[1:])) and delays[-1] == 2.0 and max(delays) == 2.0
    # a 4-minute wait polls ~125 times, not 960 (a fixed 0.25 s)
    total, calls = 0.0, 0
    for d in poll_delays(0.25, 2.0, 1.5):
        if total >= 240:
            break
        total, calls = total + d, calls + 1
    assert calls < 130


@pytest.mark.parametrize("first, cap, factor", [(0, 1, 1.5), (2, 1, 1.5), (0.1, 1, 0.5)])
def test_bad_settings_name_the_values(first, cap, factor):
    with pytest.raises(ValueError, match="first_s="):
        next(poll_delays(first, cap, factor))
