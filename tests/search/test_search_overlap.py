"""The TP overlap mode of a schedule (stp.search.overlap) and `stp search --tp-overlap`."""

import json

import pytest

from stp.cli.main import main
from stp.schedule.registry import generate
from stp.search.overlap import fastest, has_blocks, modes
from stp.sim import Costs, MemCosts, simulate


def test_modes_that_change_something():
    costs = Costs(f=1, b=1, w=1, ar=0.5)
    stp, zbv = generate("stp", 4, 8), generate("zb-v", 4, 8)
    assert has_blocks(stp) and not has_blocks(zbv)
    got = [(r.mode, r.in_layer.chunks if r.in_layer else 0) for r in modes(stp, costs, MemCosts())]
    assert got == [("braided", 0), ("none", 0), ("both", 2), ("in-layer", 2), ("both", 4),
                   ("in-layer", 4), ("both", 8), ("in-layer", 8)]
    got = [(r.mode, r.in_layer.chunks if r.in_layer else 0) for r in modes(zbv, costs, MemCosts())]
    assert got == [("braided", 0), ("both", 2), ("both", 4), ("both", 8)]


def test_fastest_is_the_shortest_step():
    costs = Costs(f=1, b=1, w=1, ar=0.5)
    zbv = generate("zb-v", 4, 8)
    results = modes(zbv, costs, MemCosts(), layers=2)
    best = fastest(results)
    assert best.makespan == min(r.makespan for r in results)
    # ZB-V exposes every collective; free chunks of 8 hide all but an eighth
    assert best.mode == "both" and best.in_layer.chunks == 8
    assert best.makespan < simulate(zbv, costs, layers=2).makespan


def test_search_cli_reports_the_modes(capsys):
    main(["search", "--pp", "2", "-m", "4", "--cost", "f=1,b=1,w=1,ar=0.5", "--memory-limit",
          "4", "--max-evaluations", "30", "--time-limit", "20", "--tp-overlap", "--json"])
    out = json.loads(capsys.readouterr().out)
    spans = [m["makespan"] for m in out["tp_overlap_modes"]]
    assert spans == sorted(spans) and len(spans) >= 4
    assert {m["tp_overlap"] for m in out["tp_overlap_modes"]} >= {"braided", "both"}
    braided = next(m for m in out["tp_overlap_modes"] if m["tp_overlap"] == "braided")
    assert braided["makespan"] == pytest.approx(out["makespan"])
