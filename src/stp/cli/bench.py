"""`stp bench overlap`, `fidelity` and `peer`: braided execution and the runtime, measured.

    stp bench overlap [--json]    # tp=2: F then B, against F braided with B
    stp bench fidelity [--json]   # pp=2 x tp=2: measured step time vs the simulator
    stp bench fidelity --sequence-parallel --tp-overlap-chunks 4   # ... with in-layer overlap
    stp bench peer [--json]       # pp=2 x tp=1|2, eager|compiled: stp vs torch pipelining

overlap: the all-reduce time left on the compute stream when F and B of two
microbatches run one after the other, and when they run as one braided block
(STP paper arXiv 2510.27257, Fig. 3); hidden_fraction = 1 - exposed(braided) / exposed(sequential),
in [0, 1], in emulated compute (stp.models.emulated) and in real compute. With
--sequence-parallel the same for the reduce-scatters and all-gathers (rows "SP",
JSON keys emulated_sp / real_sp) beside the all-reduces (rows "AR").

fidelity: the all-reduce of one unit's partial sum and the point-to-point
time are measured first; then each schedule runs on emulated stages with
fixed unit durations, and its median step time is printed next to the
simulator's makespan for the same costs (stp.sim.simulate).

peer: the same decoder, batch and schedule trained by stp's Trainer and by
PyTorch's pipelining schedule class of the same name (and by PyTorch running
stp's exported CSV), steps alternating; stp / torch per round (stp.bench.peer).
At tp2 the torch side is torchtitan's: DTensor tensor parallelism per block
under the pipelining schedule; compiled, both sides compile (torch per block).

These are benchmarks, not tests: figures depend on the machine and its load.
With --json the last stdout line is one JSON object. torch is imported only
when a command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from stp.cli.common import int_in, positive_int
from stp.cli.flags import add_flags
from stp.sim.costs import Costs
from stp.train.run.config import ModelShape

__all__ = ["register"]


def _unit_ms(text: str) -> tuple[float, float, float]:
    """`f=4,b=4,w=3` (ms per unit) -> seconds; ValueError names the bad item."""
    from stp.models.emulated import parse_times

    f, b, w = parse_times(text, "--unit-ms")
    return f / 1e3, b / 1e3, w / 1e3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure braided execution (overlap, fidelity) and "
                       "the runtime against torch's pipelining (peer)",
                       description="Measure braided execution on this machine: overlap (tp=2, "
                       "F then B against F braided with B) and fidelity (pp=2 x tp=2, measured "
                       "step times against the simulator) and stp's runtime against "
                       "torch.distributed.pipelining (peer). Figures depend on the machine.")
    bs = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    bs.required = True
    o = bs.add_parser("overlap", help="TP all-reduce hidden by a braided block (tp=2)")
    add_flags(o, ModelShape, ModelShape(layers=8, hidden=256, heads=4, seq_len=128),
              only=("layers", "hidden", "heads", "seq_len"))
    o.add_argument("--microbatch-size", type=positive_int, default=4,
                   help="sequences per microbatch (default 4)")
    o.add_argument("--unit-ms", default="f=6,b=6,w=6", metavar="f=..,b=..,w=..",
                   help="emulated milliseconds per F, B, W unit (default f=6,b=6,w=6)")
    o.add_argument("--repeats", type=positive_int, default=10, help="runs of each (default 10)")
    o.add_argument("--mode", choices=("both", "emulated", "real"), default="both",
                   help="compute: emulated, real or both (default)")
    o.add_argument("--sequence-parallel", action="store_true",
                   help="also measure sequence parallelism (reduce-scatter + all-gather in "
                   "place of each all-reduce), printed beside the all-reduce in each mode; "
                   "both with F braided with a full backward (--seq-len must be even)")
    o.add_argument("--all-to-all", action="store_true",
                   help="also measure the emulated stage with an expert all-to-all (each rank "
                   "sends half its rows to the other, as an expert-parallel MoE layer's "
                   "dispatch and combine) ending each unit in place of the all-reduce, "
                   "printed beside it")
    o.add_argument("--a2a-top-k", type=int_in(1, 64), default=2,
                   help="experts per token in that all-to-all: each unit exchanges top-k rows "
                   "per token, half of them kept (default 2: the bytes the all-reduce sends)")
    o.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    o.set_defaults(func=run_overlap)

    f = bs.add_parser("fidelity", help="measured step time vs simulated (pp=2, tp=2)")
    f.add_argument("--schedules", default="1f1b-interleaved,zb-v,stp",
                   help="comma-separated (default 1f1b-interleaved,zb-v,stp)")
    f.add_argument("--microbatches", "-m", type=positive_int, default=8,
                   help="microbatches (default 8)")
    add_flags(f, ModelShape, ModelShape(layers=2, hidden=256, seq_len=128),
              only=("layers", "hidden", "seq_len"))  # layers per chunk here
    f.add_argument("--microbatch-size", type=positive_int, default=4,
                   help="sequences b (default 4); all-reduces move [b, s, h] floats")
    f.add_argument("--unit-ms", default="f=6,b=6,w=4", metavar="f=..,b=..,w=..",
                   help="emulated milliseconds per F, B, W unit (default f=6,b=6,w=4)")
    f.add_argument("--steps", type=positive_int, default=3, help="timed steps (default 3)")
    f.add_argument("--braid", choices=("on", "off"), default="on",
                   help="run braided blocks braided (default on)")
    f.add_argument("--sequence-parallel", action="store_true",
                   help="reduce-scatter + all-gather in place of each all-reduce; each schedule "
                   "runs without and (with --tp-overlap-chunks) with in-layer TP overlap, "
                   "--rounds alternating rounds, median against the simulator's prediction")
    f.add_argument("--tp-overlap-chunks", type=int_in(2, 64), default=None, metavar="K",
                   help="with --sequence-parallel: also run each schedule with every unit's "
                   "collectives and compute cut into K chunks (in-layer TP overlap)")
    f.add_argument("--rounds", type=int_in(1, 100), default=5,
                   help="with --sequence-parallel: timed rounds, one step of each "
                   "configuration per round, in place of --steps (default 5)")
    f.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="also write DIR/<schedule>.measured.json and .simulated.json")
    f.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    f.set_defaults(func=run_fidelity)
    _register_peer(bs)


def _register_peer(bs: argparse._SubParsersAction) -> None:
    p = bs.add_parser("peer", help="stp's runtime vs torch.distributed.pipelining "
                      "(pp=2 x tp=1|2, eager and compiled)")
    p.add_argument("--schedules", default="1f1b,1f1b-interleaved,zb-v",
                   help="comma-separated, each with a PyTorch class: gpipe, 1f1b, "
                   "1f1b-interleaved, zb-v (default 1f1b,1f1b-interleaved,zb-v)")
    add_flags(p, ModelShape, ModelShape(layers=8, hidden=256, heads=4, seq_len=128),
              only=("layers", "hidden", "heads", "seq_len"))
    p.add_argument("--microbatch-size", type=positive_int, default=4,
                   help="sequences per microbatch (default 4)")
    p.add_argument("--microbatches", "-m", type=int_in(1, 4096), default=8,
                   help="microbatches (default 8)")
    p.add_argument("--pairs", type=int_in(1, 1000), default=7,
                   help="timed rounds, one step of every side each (default 7)")
    p.add_argument("--csv", choices=("on", "off"), default="on",
                   help="also run stp's exported CSV on PyTorch's runtime, eager settings "
                   "only (default on)")
    p.add_argument("--settings", type=peer_settings, default=peer_settings(",".join(PEER_SETTINGS)),
                   help=f"comma-separated from {', '.join(PEER_SETTINGS)}, one run each "
                   "(tp2: pp x tp = 4 processes; default all four)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(func=run_peer)


PEER_SETTINGS = ("tp1-eager", "tp1-compiled", "tp2-eager", "tp2-compiled")


def peer_settings(text: str) -> list[tuple[int, bool]]:
    """`tp1-eager,tp2-compiled` -> [(1, False), (2, True)]; ValueError names a bad item."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if item not in PEER_SETTINGS:
            raise argparse.ArgumentTypeError(f"setting {item!r} not accepted; choose from "
                                             f"{', '.join(PEER_SETTINGS)}")
        out.append((int(item[2]), item.endswith("compiled")))
    return out


def _launch(kind: str, settings: Any, nprocs: int) -> dict[str, Any]:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see stp.cli.train
    from stp.bench import fidelity, fidelity_inlayer, overlap
    from stp.runtime.launch import launch_local

    entry = {"overlap": overlap.entry, "inlayer": fidelity_inlayer.entry}.get(kind, fidelity.entry)
    result = launch_local(entry, (settings,), nprocs)
    if result.exitcode:
        raise ValueError(f"bench {kind}: rank(s) {result.failed_ranks} failed with status "
                         f"{result.exitcode}")
    return result.returns[0]  # type: ignore[return-value]  # rank 0 returns the figures' dict


def run_overlap(args: argparse.Namespace) -> int:
    from stp.bench.overlap import OverlapSettings
    from stp.models.emulated import UnitTimes
    from stp.shapes import ModelConfig

    modes = ("emulated", "real") if args.mode == "both" else (args.mode,)
    sp = args.sequence_parallel
    if sp and args.seq_len % 2:
        raise ValueError(f"--sequence-parallel splits the sequence over tp=2: --seq-len "
                         f"{args.seq_len} is not even (stp refuses rather than pads)")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2 or args.heads % 2:
        raise ValueError(f"--hidden {args.hidden} / --heads {args.heads}: heads must be even "
                         "(tp=2) and divide hidden into even head widths")
    model = ModelConfig(hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.heads, max_seq_len=args.seq_len)
    s = OverlapSettings(model=model, seq_len=args.seq_len,
                        microbatch_size=args.microbatch_size,
                        unit=UnitTimes(*_unit_ms(args.unit_ms)), repeats=args.repeats,
                        modes=modes, sequence_parallel=sp, all_to_all=args.all_to_all,
                        a2a_top_k=args.a2a_top_k)
    res = _launch("overlap", s, 2)
    _print_overlap(res, s, modes)
    if args.json:
        head = res.get("emulated", res.get("real"))
        print(json.dumps({"hidden_fraction": head["hidden_fraction"], **res}))
    return 0


def _print_overlap(res: dict[str, Any], s: Any, modes: tuple[str, ...]) -> None:
    ms, sp = 1e3, s.sequence_parallel
    print(f"tp=2, one stage of {s.model.num_layers} layers, microbatch [{s.microbatch_size}, "
          f"{s.seq_len}, {s.model.hidden}]; one all-reduce of it: {res['allreduce_s'] * ms:.2f} ms")
    if sp:
        print("F of mb 1 against a full backward (B, W) of mb 0; AR rows: an all-reduce ends "
              "each unit; SP rows (sequence parallel): a reduce-scatter ends each unit and an "
              "all-gather starts it")
        print("exposed: compute-stream time in collective launches + waits, all-gathers "
              "included (launches alone)")
    else:
        print("exposed: compute-stream time in all-reduce launches + waits (launches alone)")
    a2a = "emulated_a2a" in res
    if a2a:
        print(f"A2A row: an expert all-to-all of top-{s.a2a_top_k} rows per token (half of "
              "them to the other rank) ends each unit of the emulated stage instead of the "
              "all-reduce, launched from a communication thread as the MoE units launch it; "
              "AR thr row: the all-reduce launched from that thread too, for comparison")
    width, count = (16, "colls") if sp or a2a else (9, "ARs")  # mode column, collectives
    print(f"{'mode':{width}s} {count:>{len(count)}s} {'sequential':>20s} {'braided':>20s} "
          f"{'wall seq':>9s} {'wall braid':>10s} {'hidden':>7s} {'waits hidden':>12s}")
    for mode in modes:
        for key, tag in ((mode, " AR" if sp or a2a else ""), (mode + "_sp", " SP"),
                         (mode + "_a2a", " A2A"), (mode + "_ar_thread", " AR thr")):
            if key not in res:
                continue
            r = res[key]
            seq = f"{r['exposed_sequential_s'] * ms:.1f} ({r['launch_sequential_s'] * ms:.1f}) ms"
            br = f"{r['exposed_braided_s'] * ms:.1f} ({r['launch_braided_s'] * ms:.1f}) ms"
            print(f"{mode + tag:{width}s} {r['allreduces']:{len(count)}d} {seq:>20s} {br:>20s} "
                  f"{r['wall_sequential_s'] * ms:6.1f} ms {r['wall_braided_s'] * ms:7.1f} ms "
                  f"{r['hidden_fraction']:7.3f} {r['wait_hidden_fraction']:12.3f}")


def run_fidelity(args: argparse.Namespace) -> int:
    from stp.bench.fidelity import FidelitySettings
    from stp.models.emulated import UnitTimes
    from stp.schedule.registry import get
    from stp.schedule.registry import make as make_schedule
    from stp.sim import simulate

    names = tuple(n.strip() for n in args.schedules.split(",") if n.strip())
    for n in names:
        get(n)  # ValueError listing the schedules
    unit = UnitTimes(*_unit_ms(args.unit_ms))
    if args.sequence_parallel or args.tp_overlap_chunks:
        from stp.bench.inlayer_cli import run_inlayer_fidelity

        return run_inlayer_fidelity(args, names, unit, lambda s: _launch("inlayer", s, 4))
    s = FidelitySettings(
        schedules=names, microbatches=args.microbatches, layers=args.layers,
        hidden=args.hidden, seq_len=args.seq_len, microbatch_size=args.microbatch_size,
        unit=unit, steps=args.steps, braid=args.braid == "on", trace=bool(args.trace_dir),
    )
    for n in names:
        make_schedule(n, 2, s.microbatches)  # refuse before starting workers
    res = _launch("fidelity", s, 4)
    launch, ar_u, iso, comm = (res[k] for k in ("launch_s", "allreduce_s",
                                                 "allreduce_isolated_s", "p2p_s"))
    rows = []
    for r in res["rows"]:
        sch = make_schedule(r["schedule"], 2, s.microbatches)
        n = sch.chunks * 2 * s.layers  # units per microbatch per rank share
        # the launch call runs on the compute stream after each F and B unit
        costs = Costs(f=(unit.f + launch) * n, b=(unit.b + launch) * n, w=unit.w * n,
                      ar=ar_u * n, comm=comm)
        sim = simulate(sch, costs, layers=s.layers, record_spans=bool(args.trace_dir))
        nominal = simulate(sch, Costs(f=unit.f * n, b=unit.b * n, w=unit.w * n, ar=iso * n,
                                      comm=comm), layers=s.layers, record_spans=False)
        rows.append({"schedule": r["schedule"], "simulated": sim.makespan,
                     "measured": r["measured"], "error": r["measured"] / sim.makespan - 1,
                     "simulated_nominal": nominal.makespan,
                     "tp_bubble_simulated": sim.tp_bubble, "steps": r["steps"],
                     "launch_s": r["launch_s"], "wait_s_per_step": r["wait_s_per_step"]})
        if args.trace_dir:
            _write_traces(Path(args.trace_dir), sch, sim, r["spans"])
    print(f"pp=2 x tp=2, m={s.microbatches}, {s.layers} layers per chunk, units "
          f"F {unit.f * 1e3:g} / B {unit.b * 1e3:g} / W {unit.w * 1e3:g} ms (emulated), "
          f"braid {args.braid}")
    print(f"measured first, [{s.microbatch_size}, {s.seq_len}, {s.hidden}] floats: all-reduce "
          f"after a unit {ar_u * 1e3:.2f} ms (+ launch {launch * 1e3:.2f} ms; "
          f"{iso * 1e3:.2f} ms after a barrier), point-to-point {comm * 1e3:.2f} ms")
    print(f"{'schedule':18s} {'simulated':>10s} {'measured':>10s} {'error':>7s}   "
          f"{'nominal sim':>11s}")
    for r in rows:
        print(f"{r['schedule']:18s} {r['simulated'] * 1e3:7.1f} ms {r['measured'] * 1e3:7.1f} ms "
              f"{r['error']:+7.1%}   {r['simulated_nominal'] * 1e3:8.1f} ms")
    rank = lambda key: [r["schedule"] for r in sorted(rows, key=lambda r: r[key])]  # noqa: E731
    same = rank("simulated") == rank("measured")
    print(f"ranking: simulated {' < '.join(rank('simulated'))}; measured "
          f"{' < '.join(rank('measured'))} ({'same' if same else 'DIFFERENT'})")
    if args.json:
        print(json.dumps({"rows": rows, "allreduce_s": ar_u, "launch_s": launch,
                          "allreduce_isolated_s": iso, "p2p_s": comm, "same_ranking": same}))
    return 0


def run_peer(args: argparse.Namespace) -> int:
    from stp.bench.peer import PeerSpec
    from stp.bench.peer import run_peer as measure
    from stp.bench.peer_table import failed_setting, format_tables
    from stp.models import ModelConfig
    from stp.schedule.registry import make as make_schedule

    names = tuple(n.strip() for n in args.schedules.split(",") if n.strip())
    model = ModelConfig(hidden=args.hidden, num_layers=args.layers, num_heads=args.heads,
                        num_kv_heads=args.heads, max_seq_len=args.seq_len)  # a bad shape
    specs = [PeerSpec(schedules=names, pp=2, tp=tp, compile=compiled, model=model,
                      seq_len=args.seq_len, microbatch_size=args.microbatch_size,
                      microbatches=args.microbatches, pairs=args.pairs,
                      csv=args.csv == "on" and not compiled)  # ValueError names a bad value
             for tp, compiled in args.settings]
    for n in names:
        sch = make_schedule(n, 2, args.microbatches)
        if sch.chunks * 2 > args.layers:
            raise ValueError(f"--layers {args.layers}: {n} needs at least "
                             f"{sch.chunks * 2} (one per stage)")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see stp.cli.train
    results = []
    for spec in specs:
        try:
            results.append(measure(spec))
        except RuntimeError as e:  # a setting that fails is a row saying so, not the end
            print(f"bench peer: {spec.label}: {e}", file=sys.stderr)
            results.append(failed_setting(spec, f"run failed: {e}"))
    print(format_tables(results))
    if args.json:
        print(json.dumps({"settings": [{"spec": dataclasses.asdict(r["spec"]),
                                        "rows": r["rows"]} for r in results]}))
    return 0


def _write_traces(out: Path, sch: Any, sim: Any, spans: list[Any]) -> None:
    from stp.runtime.trace import write_trace as write_measured
    from stp.sim.trace_format import write_trace as write_simulated

    out.mkdir(parents=True, exist_ok=True)
    pp_of = {r: r // 2 for r in range(4)}  # tp fastest: global rank = 2 pp + tp
    write_measured(out / f"{sch.name}.measured.json", spans, sch, pp_of)
    write_simulated(sim, out / f"{sch.name}.simulated.json", time_scale=1e6)
    print(f"wrote {out / sch.name}.measured.json and .simulated.json", file=sys.stderr)
