"""`stp plan`: the fastest whole configuration of a model on a cluster.

Joins the cost model (`stp.costmodel`: costs, bytes per rank), the schedule
registry, the partition search and the simulator into one answer: the mesh,
schedule, partition, microbatching and memory levers whose simulated step is
shortest within the memory budget. Imports no torch.
"""

from stp.plan.planner import NoPlan, PlanResult, plan
from stp.plan.request import PlanRequest

__all__ = ["NoPlan", "PlanRequest", "PlanResult", "plan"]
