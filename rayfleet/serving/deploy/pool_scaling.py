"""Serve autoscaling of a pool deployment within bounds that the shared autoscaler moves.

Design decisions:
- Each pool deployment has ``autoscaling_config`` with Serve's own rule (ongoing requests per
  replica against ``target_ongoing_requests``) and a custom policy, ``bounded_pool_policy``,
  that clamps Serve's answer to ``[min, max]`` read from Ray's internal KV (``pool_bounds_key``).
  The Serve config's own ``max_replicas`` is only a hard ceiling (64): who may take
  accelerators is the shared autoscaler's decision, so without a KV entry a pool stays at its
  ``min_replicas`` (its spec's ``replicas``).
- ``deploy`` writes the spec's bounds (``replicas`` .. ``max_replicas``) when it starts the app;
  the autoscaler's Serve shell raises both bounds when it lends an accelerator (Serve starts
  the replica, placed by the pool's resource request and labels) and lowers them when it
  reclaims one (Serve drains and stops a replica: ``graceful_shutdown_timeout_s``).
  Rejected: one Serve application per lent replica (the old way; Serve could neither route to
  nor restart it as part of the pool) and re-running the app with new options (every
  imperatively run deployment gets a new code version, which restarts every engine).
- The bounds are read at most once a second per deployment (the controller runs the policy
  every control-loop tick).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

__all__ = ["HARD_MAX_REPLICAS", "pool_bounds_key", "set_pool_bounds", "get_pool_bounds", "clamp_to_bounds",
           "bounded_pool_policy", "autoscaling_config"]

HARD_MAX_REPLICAS = 64
_NAMESPACE = "rayfleet"
_CACHE: dict[str, tuple[float, tuple[int, int] | None]] = {}
_CACHE_S = 1.0


def pool_bounds_key(app_name: str, deployment: str) -> str:
    return f"serve-pool-bounds/{app_name}/{deployment}"


def set_pool_bounds(app_name: str, deployment: str, *, min_replicas: int, max_replicas: int) -> None:
    """Let Serve run ``min_replicas`` .. ``max_replicas`` replicas of the pool (needs Ray)."""
    from ray.experimental.internal_kv import _internal_kv_put

    if not 0 <= min_replicas <= max_replicas <= HARD_MAX_REPLICAS:
        raise ValueError(f"pool bounds must satisfy 0 <= min <= max <= {HARD_MAX_REPLICAS}, "
                         f"got [{min_replicas}, {max_replicas}]")
    _internal_kv_put(pool_bounds_key(app_name, deployment), json.dumps([min_replicas, max_replicas]).encode(),
                     overwrite=True, namespace=_NAMESPACE)


def get_pool_bounds(app_name: str, deployment: str) -> tuple[int, int] | None:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(pool_bounds_key(app_name, deployment), namespace=_NAMESPACE)
    if not raw:
        return None
    lo, hi = json.loads(raw)
    return int(lo), int(hi)


def clamp_to_bounds(desired: float, *, current: int, bounds: tuple[int, int] | None, base: int) -> int:
    """Serve's desired replica count clamped to the bounds (pure).

    >>> clamp_to_bounds(5.2, current=2, bounds=(1, 4), base=1)
    4
    >>> clamp_to_bounds(0.3, current=2, bounds=(2, 3), base=1)
    2
    >>> clamp_to_bounds(7.0, current=2, bounds=None, base=2)
    2
    """
    lo, hi = bounds if bounds is not None else (base, base)
    return max(lo, min(hi, math.ceil(desired - 1e-9)))


def _cached_bounds(app_name: str, deployment: str) -> tuple[int, int] | None:
    key = pool_bounds_key(app_name, deployment)
    now = time.monotonic()
    hit = _CACHE.get(key)
    if hit is None or now - hit[0] > _CACHE_S:
        try:
            hit = (now, get_pool_bounds(app_name, deployment))
        except Exception:  # noqa: BLE001 - GCS hiccup: keep the last known bounds
            hit = (now, hit[1] if hit else None)
        _CACHE[key] = hit
    return hit[1]


def bounded_pool_policy(ctx: Any) -> tuple[int, dict]:
    """Serve custom autoscaling policy (``AutoscalingContext`` -> replicas, state): Serve's
    queue-length rule, clamped to the pool's KV bounds (see module doc)."""
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    desired, state = replica_queue_length_autoscaling_policy(ctx)
    bounds = _cached_bounds(ctx.app_name or "", ctx.deployment_name)
    return clamp_to_bounds(desired, current=ctx.current_num_replicas, bounds=bounds,
                           base=ctx.capacity_adjusted_min_replicas), state


# Scale-down drains: Serve stops routing to the replica and waits for its requests, checking every
# 0.5 s (Serve's default loop is 2 s, so an idle replica sat out 2 s before it stopped).
DRAIN_OPTIONS = {"graceful_shutdown_timeout_s": 20, "graceful_shutdown_wait_loop_s": 0.5}


def autoscaling_config(*, replicas: int, target_ongoing_requests: float) -> dict[str, Any]:
    """``autoscaling_config`` of a pool deployment (see module doc)."""
    return {"min_replicas": replicas, "initial_replicas": replicas, "max_replicas": HARD_MAX_REPLICAS,
            "target_ongoing_requests": target_ongoing_requests,
            # A lent accelerator should serve within seconds; a reclaim waits a little for
            # the traffic that caused the loan to settle (the shared autoscaler already waited).
            "upscale_delay_s": 1.0, "downscale_delay_s": 5.0, "metrics_interval_s": 1.0, "look_back_period_s": 5.0,
            "policy": {"policy_function": "rayfleet.serving.deploy.pool_scaling:bounded_pool_policy"}}
