"""Cost models: compute (roofline), communication (α–β collectives), memory, pipeline schedules, step time.

Every model prices ops of :mod:`polyparallel.ir` graphs on a :class:`polyparallel.cluster.Cluster`;
a parallel configuration is a plain :class:`ParallelConfig` (degrees and options), so the models
do not depend on the search. Three read loop nests through :mod:`polyparallel.poly` (expert
dispatch footprints, spatial halos, an LSTM's carried dims); they import it inside the function
that needs it, as ``import polyparallel`` must not load islpy. The maths of each model is in its
module's docstring.
"""

from .comm import COLLECTIVES, CollectiveCost, collective_time, p2p_time, ring_time, tree_time
from .compute import COMPUTE_EFFICIENCY, OpCost, op_cost
from .memory import MemoryReport, device_memory
from .pipeline import SCHEDULES, PipelineResult, bubble_fraction, simulate
from .step import ParallelConfig, StageBreakdown, StepEstimate, estimate_step

__all__ = [
    "COLLECTIVES", "COMPUTE_EFFICIENCY", "SCHEDULES", "CollectiveCost", "MemoryReport", "OpCost", "ParallelConfig",
    "PipelineResult", "StageBreakdown", "StepEstimate", "bubble_fraction", "collective_time", "device_memory",
    "estimate_step", "op_cost", "p2p_time", "ring_time", "simulate", "tree_time",
]
