"""V placement at every memory budget: the search against V-Min, V-Half, ZB-V.

    python3 benchmarks/bench_v_search.py [--quick] [--time-limit S] [--jobs N]
                                         [--out benchmarks/results/v_search.md]

For p in {4, 8, 16}, m in {2p, 3p, 4p} (--quick: p in {4, 8}, m = 3p), memory
limits from V-Min's peak to ZB-V's in steps of 1 M_B, two cost settings and
two memory settings:

  * costs `uniform`: T_F = T_B = T_W (one time unit per chunk pass, f=b=w=2),
    no send latency; `profiled`: the Zero Bubble paper's profiled T_F, T_B,
    T_W, T_comm ("Zero Bubble Pipeline Parallelism", arXiv 2401.10241,
    Table 9): its 1.5B model's p=8, m=24 row at p=4 and p=8 (the paper has no
    p=4 run), its 14.6B model's p=16, m=48 row at p=16;
  * memory `model`: M_W / M_B = 32h / (34h + 5as) of the same model (the
    paper's Table 1); `M_W=M_B`: every activation kept until its W, as the
    controllable-memory paper ("Pipeline Parallelism with Controllable
    Memory", arXiv 2405.15362) counts it.

Each row: the makespan of v-min, v-half, zb-v where their peak fits the limit
("-" where not), of `stp search --placement v` at that limit, and the lower
bound m (T_F + T_B + T_W) (one rank's work); the gain of the search over the
best handcrafted schedule that fits, its gap to the lower bound, its time and
whether it stopped because nothing was left to try ("conv") or at its time
limit. The search is checked never to be slower than a handcrafted schedule
that fits. The table is printed and written as markdown to `--out`.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from stp.costmodel import MODELS, ZB_PROFILED, layer_activation_bytes
from stp.schedule import generate
from stp.search import search
from stp.sim import Costs, MemCosts, simulate

HANDCRAFTED = ("v-min", "v-half", "zb-v")
PROFILED = {4: ("zb-1.5b", 8, 24), 8: ("zb-1.5b", 8, 24), 16: ("zb-14.6b", 16, 48)}
TIME_LIMIT = {4: 5.0, 8: 10.0, 16: 20.0}
_EPS = 1e-9


def settings(quick: bool) -> list[tuple[int, int, str, str]]:
    """(p, m, costs name, memory name) of every group of rows."""
    out = []
    for p in (4, 8) if quick else (4, 8, 16):
        for m in (3 * p,) if quick else (2 * p, 3 * p, 4 * p):
            for cost_name in ("uniform", "profiled"):
                for mem_name in ("model", "M_W=M_B"):
                    out.append((p, m, cost_name, mem_name))
    return out


def costs_of(p: int, cost_name: str, mem_name: str) -> tuple[Costs, MemCosts]:
    model, *_ = PROFILED[p]
    m_b, m_w = layer_activation_bytes(MODELS[model])
    mem = MemCosts(1.0, m_w / m_b) if mem_name == "model" else MemCosts(1.0, 1.0)
    if cost_name == "uniform":
        return Costs(2.0, 2.0, 2.0), mem
    f, b, w, comm = ZB_PROFILED[PROFILED[p]]
    return Costs(f, b, w, comm=comm), mem


def rows_of(setting: tuple[int, int, str, str], time_limit: float | None
            ) -> list[dict[str, object]]:
    """The rows of one (p, m, costs, memory) group: one per memory limit."""
    p, m, cost_name, mem_name = setting
    costs, mem = costs_of(p, cost_name, mem_name)
    hand = {n: simulate(generate(n, p, m), costs, mem, record_spans=False) for n in HANDCRAFTED}
    low, high = max(hand["v-min"].peak_activation), max(hand["zb-v"].peak_activation)
    limits = [low + k for k in range(int(high - low + _EPS) + 1)]
    if limits[-1] < high - _EPS:
        limits.append(high)
    rows = []
    for limit in limits:
        t0 = time.perf_counter()
        got = search(p, m, costs, mem, memory_limit=limit, placement_kind="v",
                     time_limit=time_limit or TIME_LIMIT[p])
        seconds = time.perf_counter() - t0
        fits = {n: r.makespan for n, r in hand.items() if max(r.peak_activation) <= limit + _EPS}
        bound = m * (costs.f + costs.b + costs.w)
        best_hand = min(fits.values(), default=None)
        rows.append({
            "p": p, "m": m, "costs": cost_name, "mem": mem_name, "m_w": mem.m_w,
            "limit": limit, **{n: fits.get(n) for n in HANDCRAFTED},
            "search": got.result.makespan, "bound": bound,
            "gain": None if best_hand is None else 1 - got.result.makespan / best_hand,
            "gap": got.result.makespan / bound - 1, "seconds": seconds,
            "converged": got.converged, "origin": got.origin,
            "ok": all(got.result.makespan <= v + 1e-6 for v in fits.values()),
        })
    return rows


def _cell(value: object) -> str:
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def table(rows: list[dict[str, object]]) -> list[str]:
    head = ["p", "m", "costs", "M_W/M_B", "limit", *HANDCRAFTED, "search", "bound",
            "gain", "gap", "time s", "stop", "found by"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["p"]), str(r["m"]), str(r["costs"]), f"{r['m_w']:.3g}",
                 f"{r['limit']:.3g}", *(_cell(r[n]) for n in HANDCRAFTED), _cell(r["search"]),
                 _cell(r["bound"]),
                 "-" if r["gain"] is None else f"{100 * r['gain']:.1f}%",
                 f"{100 * r['gap']:.1f}%", f"{r['seconds']:.1f}",
                 "conv" if r["converged"] else "time", str(r["origin"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="p in {4, 8}, m = 3p")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="search time limit per row (default 5/10/20 s at p=4/8/16)")
    ap.add_argument("--jobs", type=int, default=1, help="rows searched in parallel")
    ap.add_argument("--out", default="benchmarks/results/v_search.md")
    args = ap.parse_args()
    groups = settings(args.quick)
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = [r for got in pool.map(rows_of, groups, [args.time_limit] * len(groups))
                for r in got]
    lines = table(rows)
    worse = [r for r in rows if not r["ok"]]
    gains = [r["gain"] for r in rows if r["gain"] is not None]
    summary = [
        "",
        f"rows: {len(rows)}; slower than a handcrafted schedule that fits: {len(worse)}; "
        f"gain over the best that fits: {100 * min(gains):.1f}% to {100 * max(gains):.1f}%; "
        f"search time {min(r['seconds'] for r in rows):.1f} to "
        f"{max(r['seconds'] for r in rows):.1f} s "
        f"({sum(bool(r['converged']) for r in rows)} rows stopped with nothing left to try)",
        f"(jobs={args.jobs}: rows searched {args.jobs} at a time on this machine)",
    ]
    print("\n".join(lines + summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# V placement search at every memory budget\n\n"
                   "Generated by `python3 benchmarks/bench_v_search.py"
                   f"{' --quick' if args.quick else ''}`; makespans in the costs' time "
                   "units, gain over the best handcrafted V schedule that fits, gap to the "
                   "lower bound m(T_F+T_B+T_W).\n\n" + "\n".join(lines + summary) + "\n")


if __name__ == "__main__":
    main()
