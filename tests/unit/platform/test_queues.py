"""Queues: spec validation, quota/borrow limits, LCA reclaim, job classes, gang admission."""

import pytest

from rayfleet.errors import SpecError
from rayfleet.platform.queues import (
    JobClass, QueueTree, Workload, admission_order, admit, parse_queue_spec, queue_usage,
)


def tree(**over):
    """root(16) -> serving(8), training(8) -> team-a(4), team-b(2); training may borrow 8."""
    specs = [
        {"name": "root", "quota": {"H100": 16}},
        {"name": "serving", "parent": "root", "quota": {"H100": 8}, "priority": 10},
        {"name": "training", "parent": "root", "quota": {"H100": 8}, "borrow_limit": {"H100": 8}},
        {"name": "team-a", "parent": "training", "quota": {"H100": 4}},
        {"name": "team-b", "parent": "training", "quota": {"H100": 2}, "borrow_limit": over.get("b_limit", {"H100": 14})},
    ]
    return QueueTree.build(parse_queue_spec(s) for s in specs)


def job(job_id, queue, size, *, min_size=None, max_size=None, cls=JobClass.ELASTIC, prio=0, started=0.0, replica=1):
    return Workload(job_id, queue, "H100", size, min_size or replica, max_size or max(size, replica), replica,
                    cls, prio, started)


def test_spec_errors_name_field_value_and_fix():
    with pytest.raises(SpecError, match=r"queue.quota.*unknown accelerator type 'H999'.*Fix"):
        parse_queue_spec({"name": "a", "quota": {"H999": 1}})
    with pytest.raises(SpecError, match=r"queue.name.*Fix: use lower-case"):
        parse_queue_spec({"name": "Bad Name"})
    with pytest.raises(SpecError, match=r"queue.colour"):
        parse_queue_spec({"name": "a", "colour": "red"})


def test_tree_rejects_unbacked_child_guarantees_and_cycles():
    with pytest.raises(SpecError, match="children are guaranteed 12"):
        QueueTree.build([parse_queue_spec({"name": "r", "quota": {"H100": 8}}),
                         parse_queue_spec({"name": "c", "parent": "r", "quota": {"H100": 12}})])
    with pytest.raises(SpecError, match="no such queue"):
        QueueTree.build([parse_queue_spec({"name": "c", "parent": "ghost"})])
    with pytest.raises(SpecError, match="cycle"):
        QueueTree.build([parse_queue_spec({"name": "a", "parent": "b"}), parse_queue_spec({"name": "b", "parent": "a"})])


def test_usage_sums_the_subtree():
    t = tree()
    usage = queue_usage(t, [job("j1", "team-a", 3), job("j2", "team-b", 2)], "H100")
    assert usage["training"] == 5 and usage["root"] == 5 and usage["serving"] == 0


def test_borrowing_uses_idle_capacity_only_and_stops_at_the_limit():
    t = tree(b_limit={"H100": 4})
    d = admit(t, job("j", "team-b", 0, min_size=6, max_size=6), running=[], free={"H100": 16})
    assert d.admitted and d.size == 6 and d.borrowed == 4 and not d.reclaims
    # 8 would exceed team-b's quota 2 + limit 4 -> gang of min 8 never starts
    d = admit(t, job("j", "team-b", 0, min_size=8, max_size=8), running=[], free={"H100": 16})
    assert not d.admitted and "quota+borrow limit" in d.reason
    # borrowing never preempts: team-b over quota with nothing idle waits
    running = [job("s", "serving", 8, cls=JobClass.OPPORTUNISTIC), job("a", "team-a", 4, cls=JobClass.GUARANTEED)]
    d = admit(t, job("j", "team-b", 0, min_size=4, max_size=4), running=running, free={"H100": 2})
    assert not d.admitted


def test_gang_admission_picks_largest_fitting_size_never_below_min():
    t = tree()
    d = admit(t, job("j", "team-b", 0, min_size=4, max_size=12, replica=4), running=[], free={"H100": 9})
    assert d.admitted and d.size == 8
    d = admit(t, job("j", "team-b", 0, min_size=4, max_size=12, replica=4), running=[], free={"H100": 3})
    assert not d.admitted and d.size == 0


def test_lender_reclaims_by_shrinking_elastic_borrowers_first_then_preempting():
    t = tree()
    # training borrows 6 of serving's idle quota: training holds 14 (quota 8)
    running = [job("el", "team-b", 8, min_size=4, max_size=8, replica=2, started=1.0),
               job("op", "team-a", 4, cls=JobClass.OPPORTUNISTIC, started=2.0),
               job("gu", "team-a", 2, cls=JobClass.GUARANTEED)]
    d = admit(t, job("srv", "serving", 0, min_size=6, max_size=6, cls=JobClass.GUARANTEED),
              running=running, free={"H100": 2})
    assert d.admitted and d.size == 6
    by_id = {r.job_id: r for r in d.reclaims}
    assert "gu" not in by_id  # guaranteed jobs are never reclaimed
    assert by_id["el"].new_size == 4 and by_id["el"].freed == 4  # elastic first, to its minimum
    assert "op" not in by_id  # 2 free + 4 shrunk covers the need: no preemption
    d = admit(t, job("srv", "serving", 0, min_size=8, max_size=8, cls=JobClass.GUARANTEED),
              running=running, free={"H100": 2})
    assert d.admitted and {r.job_id for r in d.reclaims} == {"el", "op"}
    assert next(r for r in d.reclaims if r.job_id == "op").preempted


def test_reclaim_follows_the_lca_rule():
    t = tree()
    # team-a borrows from team-b's idle share *inside* training; training stays within its quota 8.
    running = [job("a1", "team-a", 7, min_size=1, max_size=7)]
    # serving (another branch at root) may not reclaim: training is not above its quota
    d = admit(t, job("srv", "serving", 0, min_size=8, max_size=8), running=running, free={"H100": 7})
    assert not d.admitted
    # team-b (the sibling inside training) may: team-a is above its own quota 4 by 3
    d = admit(t, job("b1", "team-b", 0, min_size=2, max_size=2), running=running, free={"H100": 0})
    assert d.admitted and d.reclaims[0].job_id == "a1" and d.reclaims[0].new_size == 5


def test_guaranteed_jobs_only_start_inside_quota():
    t = tree()
    d = admit(t, job("g", "team-b", 0, min_size=4, max_size=4, cls=JobClass.GUARANTEED), running=[], free={"H100": 16})
    assert not d.admitted and "inside their queue's quota" in d.reason


def test_victims_ordered_by_priority_then_lifo():
    t = tree()
    running = [job("old", "team-b", 4, min_size=2, max_size=4, started=1.0, prio=0),
               job("new", "team-b", 4, min_size=2, max_size=4, started=5.0, prio=0),
               job("low", "team-b", 4, min_size=2, max_size=4, started=0.0, prio=-1)]
    d = admit(t, job("srv", "serving", 0, min_size=4, max_size=4), running=running, free={"H100": 0})
    assert [r.job_id for r in d.reclaims] == ["low", "new"]


def test_admission_order():
    t = tree()
    pending = [job("b", "team-b", 1, started=1.0), job("s", "serving", 1, started=2.0), job("a", "team-a", 1, prio=5, started=3.0)]
    assert [w.job_id for w in admission_order(t, pending)] == ["s", "a", "b"]


def test_workload_sizes_must_be_whole_replicas():
    with pytest.raises(SpecError, match="whole multiples"):
        Workload("j", "q", "H100", 0, 3, 8, 2)
