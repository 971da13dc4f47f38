"""`stp memory`: bytes per pipeline rank of a training step, before renting the cluster.

    stp memory --pp 2 --tp 2 --hidden 256 --seq-len 128 --schedule zb-v   # any `stp train` line
    stp memory --init-from ~/models/Qwen2-0.5B --pp 2 --seq-len 2048      # reads config.json only
    stp memory --model qwen2-12.1b --pp 2 --tp 8 --dp 4 -m 8 --seq-len 6144 \\
        --schedule stp --sequence-parallel --shard-optimizer --memory-budget 80GB
    stp memory --model ~/models/Qwen2-0.5B/config.json --pp 2 --json

Two modes, one parser. Without `--model` the command line is a `stp train`
command line (the same flags, from `stp.train.run.config.TrainJob`, with train's
defaults: float32, 4 sequences per microbatch, --seq-len 64, the toy
model): it is resolved as `stp train` resolves it (`stp.train.run.job.check_plan`:
no worker started, nothing written, --out neither created nor locked; an
--init-from directory's config.json read, never its weights) and priced by
`stp.train.run.memory_check.run_estimate`, the estimate `stp train` checks
before launching. Flags that do not change memory (--lr, --steps, --out, ...)
are accepted and ignored. With `--model PRESET|config.json` the shape is the
preset's and the defaults are a large run's (bfloat16, 1 sequence per
microbatch, the preset's sequence length, else 4096).

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
import dataclasses
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from stp.cli.common import EXIT_USAGE, mean_doc_len
from stp.costmodel import derive
from stp.costmodel.budget import over_budget, parse_size
from stp.costmodel.decoder.spec import RECOMPUTE_MODES, ModelSpec, decoder_only
from stp.costmodel.families import config_facts
from stp.costmodel.hardware import HardwareSpec
from stp.costmodel.memory import (
    CATEGORIES,
    Features,
    Layout,
    MemoryEstimate,
    estimate,
    format_bytes,
)

__all__ = ["register", "run", "model_spec"]

DEFAULT_HARDWARE = "a100-80g"
"""The device whose speed and host link price the step when --hardware is not given."""


_OWN_DEFAULTS = {"dtype": "bfloat16", "microbatch_size": 1}
"""--model mode's defaults where they are not `stp train`'s (seq-len: the preset's)."""
_SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "init_from", "tokenizer", "images")
"""Train flags that describe the model: --model describes it instead."""


def register(sub: argparse._SubParsersAction) -> None:
    from stp.cli.flags import add_flags
    from stp.train.run.config import TrainJob

    p = sub.add_parser("memory", help="bytes per rank of a training step: weights, grads, "
                       "masters, optimizer, peak activations, buffers",
                       description="Bytes per pipeline rank of a training step. Takes any "
                       "`stp train` command line (its flags and defaults), or --model with "
                       "the mesh flags.")
    p.add_argument("--model", default=None, metavar="PRESET|config.json",
                   help="a decoder preset (qwen2-12.1b, qwen2-72b, llama3-405b, ...; mixture "
                   "of experts: mixtral-8x7b, qwen2-57b-a14b, with ep=N; with "
                   ",key=val fields) or a Hugging Face config.json; default: the model "
                   "`stp train`'s flags describe")
    p.add_argument("--hardware", default=None, metavar="NAME[,key=val..]",
                   help="a100-80g, a800-80g or h100-80g: host link for offload and step "
                   f"time (default {DEFAULT_HARDWARE}), and the device memory the total is set "
                   "against (default: this machine's: its CUDA device, else its available RAM)")
    # stp train's own flags, from TrainJob: the mode's defaults are filled in later
    # where the two modes differ (dtype, microbatch size, seq-len)
    open_job = replace(TrainJob(), dtype=None, microbatch_size=None,
                       model=replace(TrainJob().model, seq_len=None))
    # memory's own --hardware (a HardwareSpec) stands for train's (an MFU peak), and
    # --model is this command's own (a preset priced on the mesh flags), not train's
    add_flags(p, TrainJob, defaults=open_job, only=tuple(
        f.name for f in dataclasses.fields(TrainJob) if f.name not in ("hardware", "model_name")))
    _action(p, "dtype").choices = (*_action(p, "dtype").choices, "float16")
    for dest, text in (("dtype", "float32, or bfloat16 with --model"),
                       ("microbatch_size", "4, or 1 with --model"),
                       ("seq_len", "64, or with --model the preset's, else 4096")):
        _action(p, dest).help += f" (default {text})"
    fields = {f.name for f in dataclasses.fields(TrainJob)}
    if "recompute" not in fields:  # until stp train has them (then theirs are used)
        p.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                       help="activation recomputation (default none)")
    if "shard_optimizer" not in fields:
        p.add_argument("--shard-optimizer", action="store_true", default=None,
                       help="fp32 masters and AdamW moments divided across dp (ZeRO stage 1)")
    if "chunks" not in fields:  # stp train runs v chunks from a schedule file
        from stp.cli.common import MAX_CHUNKS, chunk_count

        p.add_argument("--chunks", type=chunk_count, default=None,
                       help="with --model: stages per rank of 1f1b-interleaved, "
                       f"zb-interleaved or looped-bfs (default 2, at most {MAX_CHUNKS})")
    p.add_argument("--mean-doc-len", type=mean_doc_len, default=None, metavar="N|PREFIX",
                   help="document masking: price attention (the simulated step) over documents "
                   "of N tokens on average, or a prepared dataset's (its .hist.json); with "
                   "--document-mask and a prepared --data, read from it; bytes do not change")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


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


def estimate_from_args(args: argparse.Namespace) -> tuple[MemoryEstimate, str]:
    """The estimate the command line asks for, and the model's name for the report."""
    if args.model is not None and getattr(args, "plan", None) is not None:
        raise ValueError(f"--plan {args.plan} carries its model; drop --model {args.model} "
                         "(or --plan, to price the preset on the mesh flags)")
    if args.model is None:
        if getattr(args, "chunks", None) is not None:
            raise ValueError(f"--chunks {args.chunks} prices --model runs; a `stp train` "
                             "command line runs chunks from a schedule file (`stp export "
                             "--chunks`, then --schedule FILE.json)")
        return _train_estimate(args)
    return _model_estimate(args), args.model.split(",")[0]


def _model_estimate(args: argparse.Namespace) -> MemoryEstimate:
    """--model mode: a preset or a config.json on the mesh flags."""
    from stp.costmodel import parse_hardware

    given = [name for name in _SHAPE_FLAGS if getattr(args, name, None) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag} describes the model, and so does --model {args.model}: "
                         f"drop {flag}, or --model to price a `stp train` command line")
    spec = model_spec(args.model)
    if args.mean_doc_len is not None:
        spec = replace(spec, mean_doc_len=args.mean_doc_len)
    m = args.microbatches or max(8, 2 * args.pp)
    seq = args.seq_len or (spec.sequence if spec.sequence > 1 else 4096)
    # --ep where stp train has it; left at 1, a preset's own ep (`mixtral-8x7b,ep=8`)
    # is priced where it divides --dp (stp.costmodel.memory.Layout.ep)
    ep = getattr(args, "ep", None)
    layout = Layout(pp=args.pp, tp=args.tp, dp=args.dp, microbatches=m,
                    microbatch_size=args.microbatch_size or _OWN_DEFAULTS["microbatch_size"],
                    seq_len=seq, schedule=args.schedule, ep=None if ep in (None, 1) else ep,
                    chunks=getattr(args, "chunks", None))
    feats = Features(dtype=args.dtype or _OWN_DEFAULTS["dtype"],
                     sequence_parallel=bool(args.sequence_parallel),
                     recompute=args.recompute or "none",
                     shard_optimizer=bool(args.shard_optimizer), offload=args.offload)
    from stp.cli.common import check_work, generated_stages

    check_work(generated_stages(args), m, 1, f"--pp {args.pp} -m {m}")
    hardware = parse_hardware(args.hardware or DEFAULT_HARDWARE)
    if args.partition is not None:
        layout = replace(layout, partition=_partition(args.partition, spec, hardware, layout,
                                                      feats))
    return estimate(spec, hardware, layout, feats)


def _train_estimate(args: argparse.Namespace) -> tuple[MemoryEstimate, str]:
    """A `stp train` command line, resolved as train resolves it (nothing launched,
    nothing written) and priced by the estimate train checks before launching."""
    from stp.cli.common import check_work
    from stp.cli.flags import from_args
    from stp.costmodel import parse_hardware
    from stp.train.run.config import TrainJob
    from stp.train.run.precheck import precheck
    from stp.train.run.schedules import with_schedule_file

    defaults = TrainJob()
    filled = argparse.Namespace(**vars(args))
    for dest, value in (("dtype", defaults.dtype), ("microbatch_size", defaults.microbatch_size),
                        ("seq_len", defaults.model.seq_len)):
        if getattr(filled, dest) is None:
            setattr(filled, dest, value)
    job = from_args(TrainJob, filled, hardware=None)
    if job.plan is not None:  # the plan's row: its model, mesh, schedule and levers
        from stp.train.run.plan_file import with_plan

        job = with_plan(job)
    job = with_schedule_file(job)
    precheck(job)  # what the flags alone show, before torch loads (stp.train.run.precheck)
    from stp.train.run.job import check_plan
    from stp.train.run.memory_check import no_estimate_reason, run_estimate, run_features
    check_work(2 * job.pp, job.num_microbatches, 1, f"--pp {job.pp} -m {job.num_microbatches}")
    config = None
    if job.init_from is not None:  # config.json alone: the weights need not be there
        from stp.train.run.pretrained import config_json_config

        config = config_json_config(job.init_from, job.model)
    run = check_plan(job, config=config)
    reason = no_estimate_reason(run)
    if reason is not None:
        raise ValueError(f"no byte estimate for this run: {reason}")
    own = {k: getattr(args, k) for k in ("recompute", "shard_optimizer")
           if k not in {f.name for f in dataclasses.fields(TrainJob)}}
    est = run_estimate(run, parse_hardware(args.hardware or DEFAULT_HARDWARE),
                       run_features(run.job, **own), _documents(args, job))
    assert est is not None
    return est, _describe(run)


def _documents(args: argparse.Namespace, job: Any) -> int | None:
    """--mean-doc-len, else with --document-mask the mean of a prepared --data's
    .hist.json (`stp data prepare` writes one); None: no document masking priced."""
    if args.mean_doc_len is not None or not job.document_mask or job.data is None:
        return args.mean_doc_len
    try:
        return mean_doc_len(job.data)
    except argparse.ArgumentTypeError:  # no histogram beside the data: not priced
        return None


def _describe(run: Any) -> str:
    job = run.job
    where = (f"--init-from {job.init_from}" if job.init_from
             else f"--model {job.model_name}" if job.model_name
             else f"stp train's {job.arch or 'decoder'}")
    facts = config_facts(run.config)  # the family's own account (stp.costmodel.families)
    c = facts.decoder
    moe = f", {facts.experts} experts top-{facts.top_k}" if facts.experts else ""
    vision = facts.vision  # a multimodal model: its encoder, then its decoder
    if vision is not None:
        moe += (f", after a vision encoder of {vision.num_layers} blocks, width "
                f"{vision.hidden}, {vision.image_size}-pixel images")
    return (f"{where} ({c.num_layers} layers, hidden {c.hidden}, {c.num_heads} heads, "
            f"vocab {c.vocab_size}{moe})")


def _partition(text: str, spec: ModelSpec, hardware: HardwareSpec, layout: Layout,
               feats: Features) -> tuple[int, ...]:
    """--partition: explicit counts, or `auto` (`stp.search.partition`: the even
    and balanced splits, then single-layer moves while the step shortens)."""
    from stp.costmodel.stages import layered_costs
    from stp.schedule import generate
    from stp.search.partition import auto_partition
    from stp.sim.layered import parse_partition

    part = parse_partition(text)
    if isinstance(part, tuple):  # parse_partition's only other answer is "auto"
        return part
    priced = replace(spec, tp=layout.tp, sequence=layout.seq_len,
                     micro_batch=layout.microbatch_size,
                     sequence_parallel=feats.sequence_parallel, recompute=feats.recompute)
    d = derive(priced, hardware, layout.pp)
    layered = layered_costs(priced, hardware, layout.pp, d.costs, d.mem)
    sch = generate(layout.schedule, layout.pp, layout.microbatches,
                   **({} if layout.chunks is None else {"chunks": layout.chunks}))
    if priced.layers < sch.num_stages:
        raise ValueError(f"the model's {priced.layers} layers cannot fill {sch.num_stages} "
                         f"stages of {layout.schedule} at pp={layout.pp}")
    return auto_partition(sch, layered, priced.layers).counts


def run(args: argparse.Namespace) -> int:
    budget = None if args.memory_budget is None else parse_size(args.memory_budget)
    est, name = estimate_from_args(args)
    verdict = None if budget is None else over_budget(est, budget)
    device, where = _device_memory(args.hardware)
    if args.json:
        print(json.dumps({**est.to_json(), "device_memory": device or None,
                          "device_memory_of": where}))
    else:
        _print(est, name)
        if device:
            room = device - est.peak.total
            print(f"device memory ({where}): {format_bytes(device)}; "
                  + (f"{format_bytes(room)} to spare" if room >= 0
                     else f"short by {format_bytes(-room)}"))
    if verdict is not None:
        import sys

        print(f"stp: error: memory: {verdict}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _device_memory(hardware: str | None) -> tuple[int, str]:
    """(bytes, what they are) the total is set against: `--hardware`'s device, else
    this machine's CUDA device, else its available RAM (a CPU run's ranks share it)."""
    from stp.costmodel import parse_hardware

    if hardware is not None:
        return parse_hardware(hardware).memory, hardware.split(",")[0]
    if os.path.exists("/proc/driver/nvidia/version"):  # import torch only where CUDA may be
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), f"this machine's {props.name}"
    from stp.train.run.memory_check import available_host_bytes

    return available_host_bytes() or 0, "this machine's available RAM"


def format_count(n: float) -> str:
    """A parameter count people read: 140k, 504M, 12.1B."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def format_ms(ms: float) -> str:
    """A duration people read: 699.6 ms, 42.39 s, 12.5 min."""
    if ms >= 60_000:
        return f"{ms / 60_000:.3g} min"
    if ms >= 1_000:
        return f"{ms / 1_000:.4g} s"
    return f"{ms:.4g} ms"


def _print(est: MemoryEstimate, name: str) -> None:
    lay, f = est.layout, est.features
    ep = f" ep={lay.ep}" if lay.ep is not None else ""
    print(f"{name}: pp={lay.pp} tp={lay.tp} dp={lay.dp}{ep} m={lay.microbatches}"
          f" microbatch {lay.microbatch_size} x {lay.seq_len} tokens, {lay.schedule}, {f.dtype}"
          f", sp={'on' if f.sequence_parallel else 'off'} recompute={f.recompute} "
          f"shard-optimizer={'on' if f.shard_optimizer else 'off'} offload={f.offload}")
    header = ["rank", "params", *CATEGORIES, "total"]
    rows = [[str(r.rank), format_count(r.parameters),
             *(format_bytes(getattr(r, k)) for k in CATEGORIES), format_bytes(r.total)]
            for r in est.ranks]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    peak = est.peak
    print(f"peak: rank {peak.rank} (each of its {lay.tp * lay.dp} TP x DP peers), "
          f"{format_bytes(peak.total)}; largest category {peak.largest}; simulated step "
          f"{format_ms(est.step_time)}")
    for note in est.notes:
        print(f"note: {note}")
