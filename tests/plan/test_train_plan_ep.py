"""`stp train --plan PLAN.json` passes a mixture of experts' ep on, as `--ep` would."""

from __future__ import annotations

import json
from pathlib import Path

from stp.cli.main import main

TINY_MOE = ["--arch", "moe", "--experts", "4", "--top-k", "2", "--layers", "2", "--hidden",
            "16", "--heads", "2"]
"""The model `stp train` builds; the plan below is made for the same shape (the
expert width: --arch moe's default, the dense MLP's 64 / --top-k; a plan carries its
model, so `stp train --plan` trains the plan's)."""
PLAN_MODEL = ("mixtral-8x7b,layers=2,hidden=16,heads=2,kv_heads=2,ffn=64,expert_ffn=32,"
              "experts=4,top_k=2,vocab=256,sequence=8,ep=1")


def _plan(capfd, tmp_path: Path) -> tuple[str, dict]:
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", PLAN_MODEL, "--gpus", "2", "--gpus-per-node", "1",
            "--hardware", "a100-80g", "--global-batch", "4", "--seq-len", "8", "--dtype",
            "float32", "--ep", "2", "--top", "1", "--out", str(path)]
    assert main(argv) == 0
    capfd.readouterr()
    return str(path), json.loads(path.read_text())["plans"][0]


def _weights(capfd, argv: list[str]) -> float:
    assert main(argv) == 0
    out = capfd.readouterr().out
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return next(r for r in rows if r.get("summary", True) and "memory" in r)["memory"]["weights"]


def test_a_plan_at_ep_2_trains_at_ep_2(capfd, tmp_path):
    path, row = _plan(capfd, tmp_path)
    assert (row["dp"], row["ep"], row["job"]["ep"]) == (2, 2, 2)
    job = row["job"]
    flags = ["--pp", str(job["pp"]), "--dp", "2", "--schedule", job["schedule"], "-m",
             str(job["microbatches"]), "--microbatch-size", str(job["microbatch_size"]),
             "--seq-len", "8", "--dtype", "float32", "--json"]
    by_ep = {ep: _weights(capfd, ["memory", *TINY_MOE, *flags, "--ep", str(ep)])
             for ep in (1, 2)}
    assert by_ep[2] < by_ep[1]  # each rank holds half the experts
    run = ["train", *TINY_MOE, "--steps", "1", "--timeout", "120", "--json", "--plan", path,
           "--out", str(tmp_path / "run")]
    assert _weights(capfd, run) == by_ep[2]


def test_an_ep_flag_that_disagrees_with_the_plan_is_one_line(capfd, tmp_path):
    path, _ = _plan(capfd, tmp_path)
    assert main(["train", *TINY_MOE, "--ep", "4", "--plan", path]) == 2
    err = capfd.readouterr().err.strip()
    assert "\n" not in err and "--ep 4 disagrees with --plan" in err
