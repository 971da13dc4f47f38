"""Regenerate the figures the README and docs/ embed, from the generators and the simulator.

    python scripts/make_readme_figures.py            # writes docs/
    python scripts/make_readme_figures.py --out-dir /tmp/figs

tests/viz/test_readme_figures.py checks the committed SVGs are what this
script writes today, so the pictures in the README and docs/ stay true.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stp.costmodel import derive, parse_hardware, parse_model
from stp.costmodel.mllm.costs import mllm_layered_costs
from stp.schedule import generate
from stp.schedule.registry import SCHEDULES
from stp.search.partition import auto_partition
from stp.sim import Costs, SimResult, simulate
from stp.viz import compare_scene, save_scene, timeline_scene, to_svg
from stp.viz.scene import Scene

P, M = 4, 12
COSTS = Costs(f=2, b=2, w=2, ar=0.4)
"""The README's quick-start costs: per-chunk T_F = T_B = T_W = 1, T_AR = 0.2."""


MLLM_MODEL, MLLM_HARDWARE, MLLM_PP, MLLM_M = "mllm-qwen2vl-7b,tp=8", "a800-80g", 2, 8
"""The multimodal picture: Qwen2-VL-7B's shapes, STP with `--partition auto`."""


def mllm_stp() -> SimResult:
    """STP on the multimodal preset with the partition `--partition auto` picks
    (the vision encoder and a few decoder layers on stage 0: uneven stages)."""
    model = parse_model(MLLM_MODEL)
    hw = parse_hardware(MLLM_HARDWARE)
    d = derive(model, hw, MLLM_PP)
    layered = mllm_layered_costs(model, hw, MLLM_PP, d.costs, d.mem)  # type: ignore[arg-type]
    sch = generate("stp", MLLM_PP, MLLM_M)
    got = auto_partition(sch, layered, layered.num_layers or 0)
    return simulate(sch, stages=layered.table(got.counts))


def figures() -> dict[str, Scene]:
    """File name -> Scene of every figure the README and docs/ embed."""
    stp = simulate(generate("stp", P, M), COSTS)
    results = [
        simulate(generate(name, P, M), COSTS)
        for name in SCHEDULES
    ]
    results.sort(key=lambda r: (r.makespan, r.schedule.name))
    return {
        f"stp_p{P}_m{M}": timeline_scene(stp),
        f"compare_p{P}_m{M}": compare_scene(results),
        f"mllm_stp_p{MLLM_PP}_m{MLLM_M}": timeline_scene(mllm_stp()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parent.parent
    ap.add_argument("--out-dir", type=Path, default=root / "docs")
    ap.add_argument("--no-png", action="store_true", help="SVG only (no matplotlib needed)")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, scene in figures().items():
        (args.out_dir / f"{name}.svg").write_text(to_svg(scene), encoding="utf-8")
        if not args.no_png:
            save_scene(scene, args.out_dir / f"{name}.png")
        print(f"wrote {args.out_dir / name}.svg" + ("" if args.no_png else " and .png"))


if __name__ == "__main__":
    main()
