"""`stp memory`: bytes per pipeline rank of a training step, before renting the cluster.

    stp memory --model qwen2-12.1b --pp 2 --tp 8 --dp 4 -m 8 --seq-len 6144 \\
        --schedule stp --sequence-parallel --shard-optimizer --memory-budget 80GB
    stp memory --model ~/models/Qwen2-0.5B/config.json --pp 2 --json

Prints weights, gradients, fp32 masters, optimizer state, peak activations
(the simulator's memory curve) and communication buffers per rank, and names
the rank that peaks (`stp.costmodel.memory` says what each category counts).
`--json` prints one object: `{"memory": {...the peak rank's categories...,
"total"}, "peak_rank": R, "ranks": [...]}`, in bytes. With
`--memory-budget SIZE` a configuration whose peak rank exceeds SIZE is
refused in one line naming its largest category (exit 2).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from stp.cli.common import EXIT_USAGE, int_in, microbatch_count, pp_count
from stp.costmodel import derive
from stp.costmodel.budget import over_budget, parse_size
from stp.costmodel.memory import (
    CATEGORIES,
    DTYPE_BYTES,
    Features,
    Layout,
    MemoryEstimate,
    estimate,
    format_bytes,
)
from stp.costmodel.model import RECOMPUTE_MODES, ModelSpec, decoder_only
from stp.schedule.limits import MAX_MICROBATCHES, MAX_RANKS

__all__ = ["register", "run", "model_spec"]

MAX_TP = 1024
MAX_DP = 65536
MAX_SEQ_LEN = 1 << 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="bytes per rank of a training step: weights, grads, "
                       "masters, optimizer, peak activations, buffers")
    p.add_argument("--model", required=True, metavar="PRESET|config.json",
                   help="a decoder preset (qwen2-12.1b, qwen2-72b, llama3-405b, ...; with "
                   ",key=val fields) or a Hugging Face config.json")
    p.add_argument("--hardware", default="a100-80g", metavar="NAME[,key=val..]",
                   help="a100-80g (default), a800-80g or h100-80g: host link for offload, "
                   "and the device memory the total is set against")
    p.add_argument("--pp", type=pp_count, default=2, help=f"pipeline ranks (default 2, at "
                   f"most {MAX_RANKS})")
    p.add_argument("--tp", type=int_in(1, MAX_TP), default=1, help="tensor-parallel ranks")
    p.add_argument("--dp", type=int_in(1, MAX_DP), default=1, help="data-parallel replicas")
    p.add_argument("--microbatches", "-m", type=microbatch_count, default=None,
                   help=f"microbatches per step (default 8, or 2 pp when larger; at most "
                   f"{MAX_MICROBATCHES})")
    p.add_argument("--microbatch-size", type=int_in(1, 1 << 16), default=1,
                   help="sequences per microbatch (default 1)")
    p.add_argument("--seq-len", type=int_in(1, MAX_SEQ_LEN), default=None,
                   help="tokens per sequence (default: the preset's sequence, else 4096)")
    p.add_argument("--schedule", default="stp", help="schedule name (default stp)")
    p.add_argument("--partition", default=None, metavar="auto|L0,L1,..",
                   help="layers per global stage (default: the even split; auto: the "
                   "simulator's choice, as `stp simulate --partition auto`)")
    p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16",
                   help="compute dtype (default bfloat16: fp32 masters and gradients)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism (activations between TP regions s/t)")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default="none",
                   help="activation recomputation (default none)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="fp32 masters and AdamW moments divided across dp (ZeRO stage 1)")
    p.add_argument("--offload", default="none", metavar="POLICY",
                   help="activation offload: none, stp, all, selective:X (default none)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="refuse (exit 2) when the peak rank needs more: bytes, or 80GB, 80GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def model_spec(text: str) -> ModelSpec:
    """`--model`: a preset with fields, or a path ending in .json (a Hugging Face
    config.json, read bounded)."""
    if not text.isascii():
        raise ValueError(f"--model {ascii(text[:60])}: ASCII expected")
    if text.endswith(".json") or Path(text).is_dir():
        from stp.costmodel.configs import HF_MAX_BYTES, spec_from_hf_json
        from stp.files import read_json

        path = Path(text) / "config.json" if Path(text).is_dir() else Path(text)
        return spec_from_hf_json(read_json(path, HF_MAX_BYTES), str(path))
    from stp.costmodel import parse_model

    spec = parse_model(text)
    return decoder_only(spec, "stp memory")


def estimate_from_args(args: argparse.Namespace) -> MemoryEstimate:
    from stp.costmodel import parse_hardware

    spec = model_spec(args.model)
    m = args.microbatches or max(8, 2 * args.pp)
    seq = args.seq_len or (spec.sequence if spec.sequence > 1 else 4096)
    layout = Layout(pp=args.pp, tp=args.tp, dp=args.dp, microbatches=m,
                    microbatch_size=args.microbatch_size, seq_len=seq, schedule=args.schedule)
    feats = Features(dtype=args.dtype, sequence_parallel=args.sequence_parallel,
                     recompute=args.recompute, shard_optimizer=args.shard_optimizer,
                     offload=args.offload)
    from stp.cli.common import check_work, generated_stages

    check_work(generated_stages(args), m, 1, f"--pp {args.pp} -m {m}")
    hardware = parse_hardware(args.hardware)
    if args.partition is not None:
        layout = replace(layout, partition=_partition(args.partition, spec, hardware, layout,
                                                      feats))
    return estimate(spec, hardware, layout, feats)


def _partition(text: str, spec: ModelSpec, hardware: object, layout: Layout,
               feats: Features) -> tuple[int, ...]:
    """--partition: explicit counts, or `auto` (`stp.search.partition`: the even
    and balanced splits, then single-layer moves while the step shortens)."""
    from stp.costmodel.stages import layered_costs
    from stp.schedule import generate
    from stp.search.partition import auto_partition
    from stp.sim.layered import parse_partition

    part = parse_partition(text)
    if part != "auto":
        return part  # type: ignore[return-value]
    priced = replace(spec, tp=layout.tp, sequence=layout.seq_len,
                     micro_batch=layout.microbatch_size,
                     sequence_parallel=feats.sequence_parallel, recompute=feats.recompute)
    d = derive(priced, hardware, layout.pp)  # type: ignore[arg-type]
    layered = layered_costs(priced, hardware, layout.pp, d.costs, d.mem)  # type: ignore
    sch = generate(layout.schedule, layout.pp, layout.microbatches)
    if priced.layers < sch.num_stages:
        raise ValueError(f"the model's {priced.layers} layers cannot fill {sch.num_stages} "
                         f"stages of {layout.schedule} at pp={layout.pp}")
    return auto_partition(sch, layered, priced.layers).counts


def run(args: argparse.Namespace) -> int:
    budget = None if args.memory_budget is None else parse_size(args.memory_budget)
    est = estimate_from_args(args)
    verdict = None if budget is None else over_budget(est, budget)
    from stp.costmodel import parse_hardware

    device = parse_hardware(args.hardware).memory
    if args.json:
        print(json.dumps({**est.to_json(), "device_memory": device or None}))
    else:
        _print(est, args)
        if device:
            room = device - est.peak.total
            print(f"device memory ({args.hardware.split(',')[0]}): {format_bytes(device)}; "
                  + (f"{format_bytes(room)} to spare" if room >= 0
                     else f"short by {format_bytes(-room)}"))
    if verdict is not None:
        import sys

        print(f"stp: error: memory: {verdict}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _print(est: MemoryEstimate, args: argparse.Namespace) -> None:
    lay, f = est.layout, est.features
    print(f"{args.model.split(',')[0]}: pp={lay.pp} tp={lay.tp} dp={lay.dp} m={lay.microbatches}"
          f" microbatch {lay.microbatch_size} x {lay.seq_len} tokens, {lay.schedule}, {f.dtype}"
          f", sp={'on' if f.sequence_parallel else 'off'} recompute={f.recompute} "
          f"shard-optimizer={'on' if f.shard_optimizer else 'off'} offload={f.offload}")
    header = ["rank", "params", *CATEGORIES, "total"]
    rows = [[str(r.rank), f"{r.parameters / 1e9:.3g}B",
             *(format_bytes(getattr(r, k)) for k in CATEGORIES), format_bytes(r.total)]
            for r in est.ranks]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    peak = est.peak
    print(f"peak: rank {peak.rank} (each of its {lay.tp * lay.dp} TP x DP peers), "
          f"{format_bytes(peak.total)}; largest category {peak.largest}; simulated step "
          f"{est.step_time:.4g} ms")
    for note in est.notes:
        print(f"note: {note}")
