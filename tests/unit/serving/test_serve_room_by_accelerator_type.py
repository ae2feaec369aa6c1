"""Regression: an idle node of another accelerator type held a lent replica back for ``settle_s``.

The Serve shell places a lent replica once the lender looks settled (``RoomWatch``: nothing free
but the lent accelerators). It counted the free GPUs of *every* node, so on the vLLM tier's fleet
(an A100 node idle, the H100 decode pool lending) the lender never looked settled and the replica
waited out the 90 s ``settle_s``. ``free_accelerators_of_type`` feeds the watch only the nodes that
can take the pool's replica.
"""

from __future__ import annotations

from rayfleet.platform import labels as L
from rayfleet.serving.deploy.serve_scaling_rules import RoomWatch, free_accelerators_of_type


def _node(node_id: str, name: str, accelerator_type: str, *, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Labels": {L.NODE: name, L.ACCELERATOR_TYPE: accelerator_type}}


NODES = [_node("a", "n0000", "A100"), _node("h", "n0001", "H100"), _node("x", "n0002", "H100", alive=False)]
# The H100 job has re-formed around the one accelerator it lent; the A100 node is idle.
AVAILABLE = {"a": {"GPU": 4.0, "CPU": 2.0}, "h": {"GPU": 1.0}, "x": {"GPU": 8.0}}


def test_only_live_nodes_of_the_pools_accelerator_type_count():
    assert free_accelerators_of_type(NODES, AVAILABLE, resource="GPU", accelerator_type="H100") == {"n0001": 1.0}
    assert free_accelerators_of_type(NODES, AVAILABLE, resource="GPU", accelerator_type="A100") == {"n0000": 4.0}
    assert free_accelerators_of_type(NODES, AVAILABLE, resource="XPU", accelerator_type="H100") == {"n0001": 0}


def test_an_idle_node_of_another_type_no_longer_holds_the_lend_back():
    fixed = free_accelerators_of_type(NODES, AVAILABLE, resource="GPU", accelerator_type="H100")
    watch = RoomWatch("n0001", 1, settle_s=90.0, hold_s=1.0)
    assert not watch.ready(0.0, fixed, pending_lent=1)  # settled, holding
    assert watch.ready(1.0, fixed, pending_lent=1)  # placed after the 1 s hold

    # The broken variant (every live node's free GPUs) never looks settled: 90 s, not 1 s.
    every_node = {"n0000": 4.0, "n0001": 1.0}
    broken = RoomWatch("n0001", 1, settle_s=90.0, hold_s=1.0)
    assert not any(broken.ready(t, every_node, pending_lent=1) for t in range(0, 90))
    assert broken.ready(90.0, every_node, pending_lent=1)
