"""Parallelization applied from outside the model, in a fixed order, plus the step's collectives.

The order and its reasons are in :mod:`rayfleet.jobs.parallel.apply`; the step's collectives in
``collectives``; the experts' checkpoint layout in ``checkpoint_layout``; one rank's meshes and
groups in ``context``. This package only re-exports them.
"""

from rayfleet.jobs.parallel.apply import apply_recompute, parallelize_model
from rayfleet.jobs.parallel.checkpoint_layout import from_checkpoint_layout, to_checkpoint_layout
from rayfleet.jobs.parallel.collectives import (clip_grad_norm_, finalize_gradients, full_grad, full_state_dict,
                                                pipeline_forward_backward, sync_expert_load)
from rayfleet.jobs.parallel.context import A2AStats, ParallelContext, build_parallel_context
from rayfleet.jobs.parallel.context_parallel import model_inputs
from rayfleet.jobs.parallel.expert_parallel import ExpertParallelDispatcher

__all__ = [
    "A2AStats", "ParallelContext", "ExpertParallelDispatcher", "build_parallel_context", "parallelize_model",
    "apply_recompute", "to_checkpoint_layout", "from_checkpoint_layout", "finalize_gradients", "full_grad", "clip_grad_norm_", "sync_expert_load", "full_state_dict", "pipeline_forward_backward",
    "model_inputs",
]
