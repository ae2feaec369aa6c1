"""The notebook SDK: ``fleet = rayfleet.connect(); fleet.topology(); fleet.status()``.

``connect`` joins the fleet through :mod:`rayfleet.platform.connection` (an explicit address,
the job's own cluster inside ``ray job submit``, the local fleet recorded by ``rayfleet up``, or
a new local fleet for ``address="local"``) and wraps it in a :class:`Fleet`, the one object a
user holds: views, operations, training, serving, queues and the shared autoscaler hang off it.
Code inside the packages never imports this module (see docs/architecture.md); it uses the
connection directly.
"""

from __future__ import annotations

from pathlib import Path

import ray

from rayfleet.errors import SpecError
from rayfleet.platform.connection import FleetConnection
from rayfleet.platform.connection import connect as connect_fleet
from rayfleet.platform.inventory import FleetStatus, NodeStatus
from rayfleet.platform.launcher import LocalFleet
from rayfleet.platform.status_table import render_status
from rayfleet.platform.topology import FleetTopology

__all__ = ["Fleet", "connect"]


class Fleet:
    """A connection to a rayfleet fleet."""

    def __init__(self, connection: FleetConnection) -> None:
        self.address = connection.address
        self.controller = connection.controller
        self.local_fleet: LocalFleet | None = connection.local_fleet

    # -- views ----------------------------------------------------------------------------
    def topology(self) -> FleetTopology:
        """The fleet's topology, rebuilt from the live nodes' labels."""
        return FleetTopology.from_ray_nodes(ray.nodes())

    def status(self) -> FleetStatus:
        """Per-node accelerators (free / training / inference / cordoned), health and recent events."""
        return ray.get(self.controller.status.remote())

    def nodes(self) -> list[NodeStatus]:
        return list(self.status().nodes)

    def events(self, limit: int = 50, node: str | None = None) -> list:
        return ray.get(self.controller.events.remote(limit, node))

    def print_status(self) -> None:
        print(render_status(self.status()))

    # -- operations -----------------------------------------------------------------------
    def cordon(self, node: str, reason: str = "cordoned by operator") -> int:
        return ray.get(self.controller.cordon.remote(node, reason))

    def uncordon(self, node: str) -> None:
        ray.get(self.controller.uncordon.remote(node))

    def self_check(self, node: str, *, inject_fault: str | None = None) -> dict:
        return ray.get(self.controller.run_self_check.remote(node, inject_fault))

    # -- training -------------------------------------------------------------------------
    @property
    def dashboard_url(self) -> str:
        """The job API / dashboard address of the connected cluster (``http://host:port``)."""
        from rayfleet.platform.ray_compat import dashboard_url

        return dashboard_url()

    def train(self, spec, *, max_failures: int | None = None, storage_path: str | None = None):
        """Submit a training job; returns a :class:`rayfleet.jobs.training_run.TrainingRun`.

        ``spec``: a ``TrainJobSpec``, a mapping of its fields, or a job YAML path. The spec and
        its dataset are checked here, before anything is submitted.
        """
        from rayfleet.jobs.training_run import submit_training
        from rayfleet.jobs.planning import check_dataset, validate_job
        from rayfleet.jobs.spec import TrainJobSpec

        if isinstance(spec, (str, Path)):
            spec = TrainJobSpec.from_yaml(spec)
        elif not isinstance(spec, TrainJobSpec):
            spec = TrainJobSpec.model_validate(dict(spec))
        self._check_queue(spec.queue)  # an undeclared queue is refused before anything is submitted
        if spec.resources.num_workers is not None or (spec.plan is not None and spec.plan.dp is not None):
            validate_job(spec)  # dataset, plan and memory, before anything is submitted
        else:
            check_dataset(spec)  # the plan needs the live fleet's size: the job driver checks it
        return submit_training(spec, dashboard_url=self.dashboard_url, max_failures=max_failures,
                               storage_path=storage_path)

    # -- jobs after submission (Ray's job API; see rayfleet.jobs.lifecycle) ---------------------
    def _job_client(self):
        from rayfleet.jobs.lifecycle import job_client

        return job_client(self.dashboard_url)

    def jobs(self) -> list:
        """Every job on the fleet, oldest first (frozen ``JobRecord``: id, status, kind, name, queue, ...;
        a job waiting in its queue has status QUEUED, its reason and place in line)."""
        from rayfleet.jobs.lifecycle import list_jobs, with_admissions

        try:
            admissions = self.admissions()
        except (ray.exceptions.RayError, ValueError):  # the controller restarting: Ray's view alone
            admissions = []
        return with_admissions(list_jobs(self._job_client()), admissions)

    def job(self, job_id: str):
        """One job's ``JobRecord``; raises ``JobNotFoundError`` for an unknown id."""
        from rayfleet.jobs.lifecycle import get_job

        return get_job(self._job_client(), job_id)

    def job_logs(self, job_id: str, *, follow: bool = False):
        """The job's log as one string; with ``follow=True`` an iterator of chunks as the job
        writes them, ending with the job (Ray's ``tail_job_logs``: nothing is downloaded twice)."""
        from rayfleet.jobs.lifecycle import follow_logs, job_logs

        client = self._job_client()
        return follow_logs(client, job_id) if follow else job_logs(client, job_id)

    def stop_job(self, job_id: str, *, wait_s: float = 30.0):
        """Stop a job and wait up to ``wait_s`` for it to end; returns its ``JobRecord``."""
        from rayfleet.jobs.lifecycle import stop_job

        return stop_job(self._job_client(), job_id, wait_s=wait_s)

    def resume(self, job_id: str):
        """Resubmit a stopped or failed training job; it restores its newest checkpoint. Returns
        the new :class:`~rayfleet.jobs.training_run.TrainingRun`."""
        from rayfleet.jobs.lifecycle import resume_job
        from rayfleet.jobs.training_run import TrainingRun

        client = self._job_client()
        resumed = resume_job(client, job_id)
        return TrainingRun(job_id=resumed.job_id, dashboard_url=self.dashboard_url, name=resumed.spec.name,
                           total_steps=resumed.spec.steps, _client=client)

    # -- serving --------------------------------------------------------------------------------
    def serve(self, spec, *, timeout_s: float = 300.0):
        """Deploy a model on this fleet (Ray Serve); returns a
        :class:`~rayfleet.serving.deployer.ServeDeployment` once its engines answer.

        ``spec``: a ``ServeSpec``, a mapping of its fields, or a serve YAML path (see
        ``examples/serve/``). Use ``.openai_base_url`` with any OpenAI client and
        ``.shutdown()`` to delete the app. Raises ``SpecError`` for a bad spec and
        ``ServeDeployError`` if the app does not come up within ``timeout_s``.
        """
        from rayfleet.serving.deployer import deploy

        return deploy(spec, timeout_s=timeout_s)

    # -- queues and the shared autoscaler -------------------------------------------------------
    def queues(self) -> list:
        """The fleet's queues (frozen :class:`~rayfleet.platform.queues.Queue` records)."""
        from rayfleet.platform.queues import parse_queue_spec

        return [parse_queue_spec(q) for q in ray.get(self.controller.list_queues.remote())]

    def create_queue(self, name: str, *, parent: str | None = None, quota: dict | None = None,
                     borrow_limit: dict | None = None, priority: int = 0):
        """Create or replace a queue (validated here, then as a whole tree by the controller)."""
        from rayfleet.platform.queues import parse_queue_spec

        queue = parse_queue_spec({"name": name, "parent": parent, "quota": quota or {},
                                  "borrow_limit": borrow_limit, "priority": priority})
        return parse_queue_spec(ray.get(self.controller.create_queue.remote(queue.to_json())))

    def delete_queue(self, name: str) -> None:
        ray.get(self.controller.delete_queue.remote(name))

    def apply_queues(self, queues) -> dict[str, list[str]]:
        """Declare queues from a YAML file path or a list of queue mappings (``rayfleet queue
        apply``): validated with the queues already declared as one tree, then stored together.
        Returns the names ``created``, ``updated`` and ``unchanged``."""
        import yaml

        from rayfleet.platform.queues import parse_queue_file

        source = "queues"
        if isinstance(queues, (str, Path)):
            source = str(queues)
            if not Path(queues).exists():
                raise SpecError(source, source, "no such file", "pass the path of a queues YAML (see examples/queues.yaml)")
            queues = yaml.safe_load(Path(queues).read_text())
        parsed = parse_queue_file(queues, source=source)
        return ray.get(self.controller.apply_queues.remote([q.to_json() for q in parsed]))

    def admissions(self) -> list[dict]:
        """Queued and admitted training jobs: state, size, reason, place in line (queued first)."""
        return ray.get(self.controller.admissions.remote())

    def _check_queue(self, queue: str) -> None:
        from rayfleet.platform.admission import route
        from rayfleet.platform.queues import QueueTree, parse_queue_spec

        try:
            queues = ray.get(self.controller.list_queues.remote(), timeout=30)
        except (ray.exceptions.RayError, ValueError):  # no controller / restarting: the job's driver asks it
            return
        route(QueueTree.build(parse_queue_spec(q) for q in queues), queue)

    def autoscaler_step(self) -> list:
        """Run one step of the shared autoscaler now; returns its decisions (frozen
        ``rayfleet.platform.autoscaler.types`` objects: ``ScaleServe``, ``ShrinkTraining``, ...;
        also recorded as events)."""
        return ray.get(self.controller.autoscaler_step.remote())

    def start_autoscaler(self, interval_s: float = 10.0, **config) -> None:
        """Run the shared autoscaler in the controller every ``interval_s`` seconds.

        ``config``: :class:`~rayfleet.platform.autoscaler.policy.AutoscalerConfig` fields, e.g.
        ``scale_down_after_s=5, job_resize_cooldown_s=10`` (seconds of hysteresis).
        """
        ray.get(self.controller.start_autoscaler.remote(interval_s, config or None))

    def stop_autoscaler(self) -> bool:
        """Stop the shared autoscaler loop; returns whether one was running."""
        return ray.get(self.controller.stop_autoscaler.remote())

    def autoscaler_decisions(self, limit: int = 20) -> list:
        """The autoscaler's recent decisions and handovers (events with their reasons), oldest first."""
        return ray.get(self.controller.autoscaler_decisions.remote(limit))

    def autoscale_serve(self, served, **config):
        """Let the shared autoscaler scale a served model (``fleet.serve(...)``'s result) onto
        accelerators it lends from elastic training; returns a handle with ``history()``/``stop()``.

        ``config``: :class:`~rayfleet.serving.deploy.serve_scaling_rules.ServeShellConfig` fields — ``ttft_slo_s``,
        ``target_ongoing_requests``, ``max_replicas``, ``role``, ``interval_s``, ``window_s``,
        ``drain_timeout_s`` and ``replica_start_timeout_s`` (from the decision to the lent replica
        running; a vLLM engine start takes minutes on a busy CPU; past it the lend is given back).
        """
        from rayfleet.serving.serve_scaling_shell import start_serve_shell

        return start_serve_shell(served.spec, **config)

    def shutdown(self) -> None:
        """Disconnect; stop the local fleet too if this ``Fleet`` started it."""
        if ray.is_initialized():
            ray.shutdown()
        if self.local_fleet is not None:
            self.local_fleet.down()
            self.local_fleet = None

    def __repr__(self) -> str:
        return f"Fleet(address={self.address!r}, local={self.local_fleet is not None})"


def connect(
    address: str | None = None,
    *,
    nodes: int = 2,
    accelerator: str = "H100",
    accelerators_per_node: int | None = 8,
    racks: int = 1,
) -> Fleet:
    """Connect to a fleet.

    Args:
        address: ``"host:port"`` of a running cluster; ``"local"`` to start a private local
            fleet (stopped by ``fleet.shutdown()`` or at exit); ``None`` to use the cluster of
            the current Ray job, else the fleet started by ``rayfleet up``.
        nodes, accelerator, accelerators_per_node, racks: shape of the fleet started for
            ``address="local"``.

    Raises ``FleetNotFoundError`` (within seconds) when no fleet answers; see
    :func:`rayfleet.platform.connection.connect`, which does the joining.
    """
    return Fleet(connect_fleet(address, nodes=nodes, accelerator=accelerator,
                               accelerators_per_node=accelerators_per_node, racks=racks))
