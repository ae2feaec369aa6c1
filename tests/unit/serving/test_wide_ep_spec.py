"""A wide-EP pool's spec (``ranks_per_replica``) is checked at the edge, naming field, value and fix,
and maps onto a gang's Serve options: bundle 0 for the front, one labelled accelerator per rank."""

from __future__ import annotations

import pytest

from rayfleet.errors import SpecError
from rayfleet.serving.deploy.deployments import pool_deployment_options
from rayfleet.serving.spec import ServeSpec

MOE = {"preset": "tiny", "overrides": {"num_experts": 8}}


def _spec(**decode) -> dict:
    return {"model": MOE, "mode": "disaggregated", "decode": {"ranks_per_replica": 4, "accelerators_per_replica": 4,
                                                              "accelerator_type": "H100", **decode}}


def test_a_gang_pool_gets_one_placement_group_of_labelled_bundles():
    spec = ServeSpec.parse({**_spec(), "expert_balancing": {"enabled": True, "num_redundant_experts": 4}})
    options = pool_deployment_options(spec, "decode")
    assert options["placement_group_bundles"] == [{"CPU": 0.01}] + [{"GPU": 1.0}] * 4
    assert options["placement_group_strategy"] == "PACK"
    assert options["placement_group_bundle_label_selector"] == [{"rayfleet.io/accelerator-type": "H100"}] * 5
    assert options["ray_actor_options"] == {"num_cpus": 0.01}  # the front holds no accelerator
    cpu_only = ServeSpec.parse(_spec(accelerators_per_replica=0, accelerator_type=None))
    assert pool_deployment_options(cpu_only, "decode")["placement_group_bundles"][1:] == [{"CPU": 0.01}] * 4
    assert "placement_group_bundles" not in pool_deployment_options(spec, "prefill")  # one rank: as before


@pytest.mark.parametrize("change, field, fix", [
    ({"decode": {"ranks_per_replica": 4, "accelerators_per_replica": 2}}, "decode.accelerators_per_replica",
     "set it to 4"),
    ({"decode": {"ranks_per_replica": 3, "accelerators_per_replica": 3}}, "expert_balancing.num_redundant_experts",
     "use 1"),
    ({"model": {"preset": "tiny", "overrides": {"num_experts": 8, "capacity_factor": 1.0}}},
     "model.overrides.capacity_factor", "drop capacity_factor"),
    ({"model": {"preset": "tiny", "overrides": {"num_experts": 8, "num_dense_layers": 3}}}, "decode.ranks_per_replica",
     "MoE preset"),
    ({"model": {"checkpoint": "file:///tmp/x"}}, "decode.ranks_per_replica", "serve a preset"),
    ({"long_context": {"split_threshold_tokens": 64}}, "long_context.split_threshold_tokens", "leave long_context"),
    ({"kv_cache": {"host_blocks": 64}}, "kv_cache", "drop kv_cache"),
])
def test_what_a_gang_cannot_run_is_refused_by_name(change, field, fix):
    data = {**_spec(), **change}
    if "decode" in change:
        data["decode"] = {**_spec()["decode"], **change["decode"]}
    with pytest.raises(SpecError) as err:
        ServeSpec.parse(data)
    assert err.value.field == field and fix in str(err.value), str(err.value)
