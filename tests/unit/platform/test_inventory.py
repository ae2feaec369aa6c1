import pytest

from rayfleet.platform.inventory import HealthPolicy, NodeRecord, usage_from_observation
from rayfleet.platform.state_store import Event, StateStore


def test_usage_attributes_holdings_by_group_name():
    usage = usage_from_observation(total=8, available=1, group_holdings=[
        ("rayfleet:train:job1", 4), ("rayfleet:serve:chat", 1), ("SERVE_REPLICA::x", 1), ("rayfleet:cordon:n1:0", 0)])
    assert (usage.free, usage.training, usage.inference, usage.cordoned, usage.other) == (1, 4, 2, 0, 1)
    assert usage.free + usage.training + usage.inference + usage.cordoned + usage.other == usage.total


def test_usage_clamps_when_groups_exceed_held():
    usage = usage_from_observation(total=8, available=6, group_holdings=[("rayfleet:train:a", 4)])
    assert usage.training <= 2 and usage.free == 6 and usage.other >= 0


@pytest.mark.parametrize("record, health", [
    (NodeRecord("n", {}, alive=False, last_heartbeat=99.0), "dead"),
    (NodeRecord("n", {}, last_heartbeat=99.0, self_check_ok=False), "suspect"),
    (NodeRecord("n", {}, last_heartbeat=None), "unreachable"),
    (NodeRecord("n", {}, last_heartbeat=50.0), "unreachable"),
    (NodeRecord("n", {}, last_heartbeat=95.0), "healthy"),
])
def test_health_policy(record, health):
    assert HealthPolicy(heartbeat_timeout_s=15).decide(record, now=100.0)[0] == health


def test_state_store_persists_across_reopen(tmp_path):
    path = tmp_path / "state.sqlite"
    store = StateStore(path)
    record = NodeRecord("n0001", {"rayfleet.io/node": "n0001"}, cordoned=True, cordon_reason="maint")
    store.put("node/n0001", record.to_json())
    store.put("node/n0002", NodeRecord("n0002", {}).to_json())
    store.put("queue/a", {"x": 1})
    store.append_event(Event(1.0, "cordoned", "n0001", "maint", {"k": 1}))
    store.close()
    again = StateStore(path)
    nodes = dict(again.items("node/"))
    assert set(nodes) == {"node/n0001", "node/n0002"}
    assert NodeRecord.from_json(nodes["node/n0001"]) == record
    assert again.events()[0].cause == "maint" and again.events(subject="nobody") == []
    again.delete("node/n0002")
    assert again.get("node/n0002") is None
