"""Auto-scheduler: the fastest schedule within a memory limit, braided or not.

Pure (no torch): builds schedules in the IR of `stp.schedule`, judged by
`stp.sim`. See `stp.search.entry` for the method.
"""

from stp.search.entry import OBJECTIVES, Baseline, SearchResult, min_memory_limit, search
from stp.search.greedy import Built, build
from stp.search.space import Policy, policies, warmup_caps

__all__ = [
    "OBJECTIVES",
    "Baseline",
    "Built",
    "Policy",
    "SearchResult",
    "build",
    "min_memory_limit",
    "policies",
    "search",
    "warmup_caps",
]
