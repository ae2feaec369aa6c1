"""Discrete-time simulator of a shared training + inference fleet (see ``engine``).

It drives the same :class:`~rayfleet.platform.autoscaler.policy.AutoscalerPolicy` the fleet
controller runs, over Philly training arrivals and a diurnal inference envelope with Azure
request sizes, against two baselines (a static split and Kueue-style whole-job preemption).
"""

from rayfleet.platform.sim.baselines import POLICIES, build_simulation, run_policy
from rayfleet.platform.sim.costs import CostModel
from rayfleet.platform.sim.engine import SimConfig, Simulation
from rayfleet.platform.sim.sim_metrics import SimResult

__all__ = ["POLICIES", "CostModel", "SimConfig", "SimResult", "Simulation", "build_simulation", "run_policy"]
