"""Node agent: one Ray actor per fleet node, pinned to it by label.

It reports the node's accelerators and health to the fleet controller on a heartbeat, runs the
deterministic GEMM self-check (:mod:`rayfleet.platform.selfcheck`), and cordons/uncordons its
node.

Cordon design: Ray 2.60 has no reversible "unschedulable" switch (draining is one-way, node
labels are fixed at start), so a cordon *reserves* everything still free on the node in a
placement group named ``rayfleet:cordon:<node>:<k>``. Nothing new can land there; work already
running keeps going, and whatever it frees later is reserved by the next heartbeat. Uncordon
removes the groups. The reservation is also how ``rayfleet status`` counts cordoned
accelerators, through Ray's own accounting.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rayfleet.platform import labels as L
from rayfleet.platform.inventory import CORDON_PG_PREFIX
from rayfleet.platform.selfcheck import flip_one_bit, run_gemm_self_check

__all__ = ["NodeAgent", "agent_name", "AGENT_NAMESPACE"]

log = logging.getLogger(__name__)
AGENT_NAMESPACE = "rayfleet"


def agent_name(node: str) -> str:
    return f"rayfleet_agent:{node}"


def _node_available(node_id: str) -> dict[str, float]:
    from rayfleet.platform.ray_compat import available_resources_per_node

    return dict(available_resources_per_node().get(node_id, {}))


def _probe_devices() -> list[dict]:
    """Real accelerators when present (pynvml, else torch.cuda); empty on CPU machines."""
    try:
        import pynvml  # type: ignore

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append({"index": i, "name": pynvml.nvmlDeviceGetName(h), "memory_total": mem.total,
                        "memory_used": mem.used, "temperature_c": pynvml.nvmlDeviceGetTemperature(h, 0)})
        return out
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return [{"index": i, "name": torch.cuda.get_device_name(i),
                     "memory_total": torch.cuda.get_device_properties(i).total_memory}
                    for i in range(torch.cuda.device_count())]
    except Exception:
        pass
    return []


class NodeAgent:
    """The per-node actor. Created by the fleet controller with ``num_cpus=0`` and a node label selector."""

    def __init__(self, node_name: str, controller_name: str, *, heartbeat_s: float = 2.0,
                 self_check_every_s: float = 300.0) -> None:
        ctx = ray.get_runtime_context()
        self.node_name = node_name
        self.node_id = ctx.get_node_id()
        self.labels = dict(ctx.get_node_labels())
        if self.labels.get(L.NODE) != node_name:  # the label selector guarantees this
            raise RuntimeError(f"agent for {node_name} landed on {self.labels.get(L.NODE)}")
        self.controller_name = controller_name
        self.heartbeat_s = heartbeat_s
        self.self_check_every_s = self_check_every_s
        self._lock = threading.RLock()
        self._fault: str | None = None
        self._cordon_reason: str | None = None
        self._cordon_groups: list = []
        self._last_check: dict | None = None
        self._last_check_at = 0.0
        self._stop = threading.Event()
        self.self_check()
        threading.Thread(target=self._loop, name="heartbeat", daemon=True).start()

    # -- heartbeat --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if time.time() - self._last_check_at > self.self_check_every_s:
                    self.self_check()
                if self._cordon_reason is not None:
                    self._reserve_free()
                controller = ray.get_actor(self.controller_name, namespace=AGENT_NAMESPACE)
                controller.heartbeat.remote(self.report())
            except Exception as exc:  # the controller may be restarting; keep beating
                log.debug("heartbeat failed: %s", exc)
            self._stop.wait(self.heartbeat_s)

    def report(self) -> dict:
        """What the controller learns each heartbeat (plain JSON-able data)."""
        with self._lock:
            return {
                "node": self.node_name, "ray_node_id": self.node_id, "pid": os.getpid(),
                "labels": self.labels, "cordoned": self._cordon_reason is not None,
                "cordon_reason": self._cordon_reason or "", "self_check": self._last_check,
                "devices": _probe_devices(), "load_avg": os.getloadavg()[0],
                # Declared (virtual on CPU machines) accelerators: index = rail.
                "accelerators": {"type": self.labels.get(L.ACCELERATOR_TYPE),
                                 "count": int(self.labels.get(L.NUM_ACCELERATORS, 0))},
            }

    # -- self-check -------------------------------------------------------------------------
    def self_check(self) -> dict:
        """Run the GEMM self-check now; a failing node is reported suspect by the controller."""
        corrupt = flip_one_bit if self._fault == "sdc" else None
        import torch

        # The agent holds no GPU (num_cpus=0, no num_gpus): Ray hides them unless the node agent
        # is given visibility, in which case checking the first device is representative.
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        result = run_gemm_self_check(corrupt=corrupt, clock=time.perf_counter, device=device)
        with self._lock:
            self._last_check = {"ok": result.ok, "checksum": result.checksum, "expected": result.expected,
                                "repeatable": result.repeatable, "seconds": result.seconds,
                                "device": result.device, "at": time.time()}
            self._last_check_at = time.time()
            return dict(self._last_check)

    def inject_fault(self, kind: str | None) -> None:
        """Fault injection for tests and drills: ``"sdc"`` corrupts GEMM results, ``None`` heals."""
        if kind not in (None, "sdc"):
            raise ValueError(f"fault kind {kind!r} is unknown. Fix: use 'sdc' or None")
        self._fault = kind

    # -- cordon -----------------------------------------------------------------------------
    def cordon(self, reason: str) -> int:
        """Reserve everything free on this node; return how many accelerators the reservation holds."""
        with self._lock:
            self._cordon_reason = reason or "cordoned"
            self._reserve_free()
            return self._cordoned_accelerators()

    def uncordon(self) -> None:
        with self._lock:
            self._cordon_reason = None
            for group in self._cordon_groups:
                remove_placement_group(group)
            self._cordon_groups = []

    def _reserve_free(self) -> None:
        with self._lock:
            free = _node_available(self.node_id)
            bundle = {k: v for k, v in free.items()
                      if v >= 1 and (k in ("CPU", "GPU", "NPU", "XPU") or L.slot_index(k) is not None)}
            bundle = {k: float(int(v)) for k, v in bundle.items()}
            if not bundle:
                return
            group = placement_group(
                [bundle], strategy="STRICT_PACK",
                name=f"{CORDON_PG_PREFIX}{self.node_name}:{len(self._cordon_groups)}",
                bundle_label_selector=[{L.NODE: self.node_name}],
            )
            if group.wait(timeout_seconds=10):
                self._cordon_groups.append(group)
            else:  # raced with another reservation; try again next heartbeat
                remove_placement_group(group)

    def _cordoned_accelerators(self) -> int:
        total = 0
        for group in self._cordon_groups:
            for spec in group.bundle_specs:
                total += int(sum(v for k, v in spec.items() if k in ("GPU", "NPU", "XPU")))
        return total

    def ping(self) -> str:
        return self.node_name

    def shutdown(self) -> None:
        self._stop.set()
        self.uncordon()
