"""A serving pool's queue: the field a serve spec's pool names, and what it asks the queue for.

``queue`` works as a training job's does (``jobs/spec.py``): ``default`` (the default) runs the
pool outside the queues while no queue of that name is declared, and under its rules once one is;
any other name must be a declared leaf queue, or the deploy is refused with the fix. The rules
(admitted at once or refused, guaranteed, never borrowing, growth capped by its queues) are the
platform's: ``platform/serve_admission.py`` builds the request and the fleet controller admits it
with the functions that admit training jobs.

A mixin of ``PoolSpec`` in its own module, as ``pool_parallelism`` is, so ``spec`` keeps one
responsibility per model.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from rayfleet.platform.admission import AdmissionRequest
from rayfleet.platform.serve_admission import serve_pool_request

__all__ = ["PoolQueueFields"]


class PoolQueueFields(BaseModel):
    """``queue``: the leaf queue whose quota the pool's accelerators count against."""

    queue: str = Field("default", min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

    def admission_request(self, *, app: str, role: str) -> AdmissionRequest | None:
        """What this pool asks its queue for (``None``: it asks for no accelerators).

        Raises:
            SpecError: a named queue on a pool without an accelerator type to count.
        """
        return serve_pool_request(app=app, role=role, queue=self.queue,
                                  accelerator_type=getattr(self, "accelerator_type", None),
                                  accelerators_per_replica=int(getattr(self, "accelerators_per_replica", 0)),
                                  replicas=int(getattr(self, "replicas", 1)),
                                  max_replicas=getattr(self, "max_replicas", None))
