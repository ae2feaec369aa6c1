"""The integration tier ends with a check that nothing it started is still running.

Every process the tier starts carries this session's marker (``tests/process_leaks.py``); at the
end of the session the processes that carry it and were not there at the start — with the ports
they listen on — must be gone (after a grace period: Ray workers and SSH control masters take a
few seconds to notice that their cluster went away). A leftover fails the session's last test
with the list of what remains; nothing is killed here, so the failure shows what leaked.
"""

from __future__ import annotations

import os

import pytest

from process_leaks import MARKER_VAR, describe, mark_session, snapshot, wait_for_no_leftovers


# The tier runs two tests at a time (scripts/test_tiers.py, INTEGRATION_WORKERS): the longest are
# collected first (seconds measured alone on 2026-11-29), so that the two workers end together
# instead of one starting a long test when the other is done.
_LONGEST_FIRST = ("test_quickstart_notebook",  # 148 s
                  "[recovery]", "[handover]", "[quality]", "[serving]", "[train_scaling]",  # 131-57 s
                  "test_ray_up")  # 62 s; then the short quick runs


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        return next((i for i, key in enumerate(_LONGEST_FIRST) if key in item.nodeid), len(_LONGEST_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    previous = os.environ.get(MARKER_VAR)
    marker = mark_session()
    before = snapshot()
    yield marker
    found = wait_for_no_leftovers(before, marker, grace_s=60.0)
    if previous is None:
        os.environ.pop(MARKER_VAR, None)
    else:
        os.environ[MARKER_VAR] = previous
    assert not found, f"the integration tests left {len(found)} process(es) running:\n{describe(found)}"
