"""`stp search` seeds from the schedules PyTorch ships that stp added: each
is a baseline, and braided DualPipeV (V placement, F&B blocks) seeds the
search, so the result is never slower where it fits the limit."""

import pytest

from stp.schedule import validate
from stp.search import search
from stp.sim import Costs, MemCosts

NEW = ("looped-bfs", "zb-interleaved", "dualpipev")


def test_new_schedules_are_baselines_and_dualpipev_seeds():
    costs, mem = Costs(2, 2, 1, ar=0.4), MemCosts()
    got = search(4, 8, costs, mem, memory_limit=5, time_limit=3)
    validate(got.schedule, memory_limit=5, mem=mem)
    base = {b.name: b for b in got.baselines}
    assert set(NEW) <= set(base)
    # at this setting DualPipeV is the fastest handcrafted schedule that fits
    fitting = [b for b in got.baselines if b.result is not None and not b.note]
    best = min(fitting, key=lambda b: b.result.makespan)
    assert best.name == "dualpipev"
    assert got.result.makespan <= best.result.makespan + 1e-9
    # looped-bfs holds every microbatch (m M_B = 8) and is over the limit
    assert base["looped-bfs"].note == "peak 8 > limit 5"


@pytest.mark.parametrize("placement", ["looped", "v"])
def test_search_space_restricted_still_lists_them(placement):
    got = search(2, 4, Costs(1, 1, 1), MemCosts(), memory_limit=4, time_limit=1,
                 placement_kind=placement)
    assert set(NEW) <= {b.name for b in got.baselines}
