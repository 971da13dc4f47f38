"""`stp plan`: the fastest whole configuration of a model on a cluster.

    stp plan --model llama3-405b --gpus 16384 --hardware h100-80g \\
        --global-batch 2048 --seq-len 8192 --top 5
    stp plan --model mixtral-8x7b --gpus 64 --hardware h100-80g --global-batch 512 \\
        --seq-len 4096            # a mixture of experts: ep searched too (--ep N,M: only those)
    stp plan --model ~/models/Qwen2-0.5B --gpus 4 --gpus-per-node 4 --hardware a100-80g \\
        --global-batch 64 --seq-len 1024 --out plan.json   # then: stp train --plan plan.json

Enumerates meshes, microbatching, schedules, partitions and memory levers,
prunes by memory and time bounds before simulating, ranks by simulated step
time (`stp.plan`). Prints the top K with their `stp train` flags and why the
best beats the runner-up; `--json` prints one object with a `plans` list;
`--out PLAN.json` writes that object for `stp train --plan`. A request with
no mesh, or none that fits, is one line saying what would be needed (exit 2).

The plan records the model (format 2): every row's `stp train` line starts
with `--model PRESET` or `--model /abs/path/config.json` (whose sha256 the plan
keeps, and `stp train --plan` checks). On a terminal a progress line on stderr
(configurations, those pruned by memory, those priced, the best step so
far, the time spent) is rewritten every `PROGRESS_EVERY_S` seconds (looked
at between two pricings) and cleared before the table; nothing with
`--json` or when stderr is not a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from stp.cli.common import EXIT_USAGE, int_in, mean_doc_len
from stp.plan.request import MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ_LEN

if TYPE_CHECKING:
    from stp.costmodel.hardware import HardwareSpec
    from stp.plan import PlanRequest, PlanResult

__all__ = ["register", "run", "request_from_args", "local_hardware", "ProgressLine",
           "PROGRESS_EVERY_S"]

PROGRESS_EVERY_S = 1.0
"""Seconds between two progress lines. The search looks at the clock between
two pricings, and one pricing takes under a second of CPU at the largest sizes
(`stp.plan.space.MAX_STAGE_MICROBATCHES`), so a line comes at least every 2 s
on a machine that is not overloaded."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="the fastest mesh, schedule, partition, microbatching and "
                       "memory levers for a model on a cluster")
    p.add_argument("--model", required=True, metavar="PRESET|config.json",
                   help="a decoder preset (qwen2-12.1b, qwen2-72b, llama3-405b, ...; mixtures "
                   "of experts: mixtral-8x7b, qwen2-57b-a14b; with ,key=val fields), key=val "
                   "fields, or a Hugging Face config.json / directory (Qwen2-MoE, Mixtral too)")
    p.add_argument("--gpus", required=True, type=int_in(1, MAX_GPUS), help="GPUs in the cluster")
    p.add_argument("--hardware", default="h100-80g", metavar="NAME[,key=val..]|local",
                   help="a100-80g, a800-80g or h100-80g (default), with fields; `local`: "
                   "calibrate this machine with a short run; fields fitted by --calibrate "
                   "replace the preset's")
    p.add_argument("--global-batch", required=True, type=int_in(1, MAX_GLOBAL_BATCH),
                   help="sequences per optimizer step over all replicas")
    p.add_argument("--seq-len", required=True, type=int_in(1, MAX_SEQ_LEN),
                   help="tokens per sequence")
    p.add_argument("--gpus-per-node", type=int_in(1, 1024), default=8,
                   help="GPUs per node: tensor parallelism stays within one (default 8)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="bytes one GPU may hold (80GB, 80GiB; default: the hardware's memory)")
    p.add_argument("--top", type=int_in(1, 1000), default=5, help="plans printed (default 5)")
    p.add_argument("--schedules", default=None, metavar="a,b,..",
                   help="only these schedules (default: all; braided ones only with tp > 1)")
    p.add_argument("--partition", choices=("auto", "even"), default="auto",
                   help="auto (default): the top plans also try the balanced and auto "
                   "layer partitions; even: never")
    p.add_argument("--max-microbatch-size", type=int_in(1, 1 << 16), default=8,
                   help="largest microbatch size tried (default 8)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="compute dtype of the runs (default bfloat16)")
    p.add_argument("--no-offload", action="store_true",
                   help="never turn on activation offload")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="never turn on sequence parallelism")
    p.add_argument("--no-tp-overlap", action="store_true",
                   help="keep every plan's braiding as its schedule has it and never try "
                   "in-layer TP overlap (default: the top plans try none / braided / "
                   "in-layer / both at K = 2, 4, 8 chunks)")
    p.add_argument("--ep", default=None, metavar="N[,M..]",
                   help="a mixture of experts: only these expert-parallel sizes (default: "
                   "every divisor of dp that divides the experts, 1 included; a preset's own "
                   "ep is not kept)")
    p.add_argument("--calibrate", nargs="+", default=None, metavar="TRACE.json",
                   help="fit the hardware's efficiency and links to traces of `stp train "
                   "--trace`, and time this machine's matmuls at s/K rows for in-layer TP "
                   "overlap (stp.plan.calibrate)")
    p.add_argument("--mean-doc-len", type=mean_doc_len, default=None, metavar="N|PREFIX",
                   help="price attention for document masking (`stp train --document-mask`): "
                   "N tokens per document on average, or a dataset `stp data prepare` wrote "
                   "(its .hist.json's mean); default: every token attends over the sequence")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, metavar="PLAN.json",
                   help="write the plans for `stp train --plan PLAN.json`")
    p.set_defaults(func=run)


def _schedules(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    from stp.schedule.registry import get

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise ValueError("--schedules: give schedule names separated by commas")
    for name in names:
        get(name)  # ValueError naming the schedules accepted
    return names


def _ep_sizes(text: str | None) -> tuple[int, ...] | None:
    """`--ep 2,4,8`: the sizes (PlanRequest checks them against the experts)."""
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip()) or ()
    except ValueError:
        raise ValueError(f"--ep {text[:40]!r}: integers separated by commas expected "
                         "(2,4,8)") from None


_LOCAL_MODEL = {"layers": 4, "hidden": 64, "heads": 4, "seq_len": 64, "microbatches": 4}
"""The model `--hardware local` trains for a few steps to measure this machine."""


def local_hardware() -> HardwareSpec:
    """This machine, measured: a traced 3-step run of a small decoder on
    pp 2 x tp 2 local workers (`stp train --trace`), fitted by
    `stp.plan.calibrate` (compute efficiency against a nominal 1e11 FLOP/s
    peak, TP all-reduce and send latency); memory: the machine's RAM."""
    import subprocess
    import tempfile

    from stp.costmodel.decoder.costs import head_flops
    from stp.costmodel.decoder.spec import ModelSpec, layer_flops
    from stp.costmodel.hardware import HardwareSpec
    from stp.plan.calibrate import fit_traces, gemm_rows_fit

    lm = _LOCAL_MODEL
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        cmd = [sys.executable, "-m", "stp", "train", "--pp", "2", "--tp", "2", "--schedule",
               "1f1b", "--layers", str(lm["layers"]), "--hidden", str(lm["hidden"]),
               "--heads", str(lm["heads"]), "--seq-len", str(lm["seq_len"]),
               "--microbatch-size", "1", "-m", str(lm["microbatches"]), "--steps", "3",
               "--trace", trace, "--out", os.path.join(tmp, "run"), "--timeout", "120"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ValueError(f"--hardware local: the calibration run failed: {tail[:200]}")
        spec = ModelSpec(layers=lm["layers"], hidden=lm["hidden"], heads=lm["heads"],
                         kv_heads=lm["heads"], ffn=4 * lm["hidden"], vocab=256,
                         sequence=lm["seq_len"], tp=2, flash_attention=True, dropout=False)
        per_stage = lm["layers"] // 2 * sum(layer_flops(spec))
        flops = [per_stage, per_stage + 3 * head_flops(spec)]
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        base = HardwareSpec(peak_flops=1e11, efficiency=0.5, tp_bandwidth=1e9,
                            pp_bandwidth=1e9, host_bandwidth=1e9, name="local",
                            memory=float(memory))
        fit = fit_traces([trace], flops)
        fit.gemm_rows = gemm_rows_fit(gemm_seconds())
        return fit.apply(base)


def gemm_seconds(width: int = 512, repeats: int = 5) -> dict[int, float]:
    """This machine's time of one matmul of (rows x width) @ (width x width) at each of
    `GEMM_PROBE_ROWS` (s = 2048 and its chunks s/2, s/4, s/8): the median of
    `repeats` after a warm-up, for `stp.plan.calibrate.gemm_rows_fit`."""
    import statistics
    import time

    import torch

    from stp.plan.calibrate import GEMM_PROBE_ROWS

    weight = torch.randn(width, width)
    out = {}
    for rows in GEMM_PROBE_ROWS:
        x = torch.randn(rows, width)
        x @ weight  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            x @ weight
            times.append(time.perf_counter() - t0)
        out[rows] = max(statistics.median(times), 1e-9)
    return out


def _hardware(args: argparse.Namespace) -> HardwareSpec:
    from stp.costmodel import parse_hardware
    from stp.plan.calibrate import calibrated

    if args.hardware.split(",")[0].strip() == "local":
        if args.hardware.strip() != "local":
            raise ValueError("--hardware local takes no fields (it measures them)")
        base = local_hardware()
    else:
        base = parse_hardware(args.hardware)
    if args.calibrate:  # traces of this machine: its matmuls are timed here too
        base = calibrated(base, args.calibrate, gemm_seconds())
    return base


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    from dataclasses import replace

    from stp.cli.memory import model_spec
    from stp.costmodel.budget import parse_size
    from stp.plan import PlanRequest

    spec = model_spec(args.model)
    source, sha = _source(args.model)
    spec = spec.with_ep(1)  # the planner chooses ep (a preset says ep=8)
    budget = None if args.memory_budget is None else parse_size(args.memory_budget)
    return PlanRequest(
        model=replace(spec, tp=1, mean_doc_len=args.mean_doc_len),
        hardware=_hardware(args), gpus=args.gpus,
        global_batch=args.global_batch, seq_len=args.seq_len,
        gpus_per_node=args.gpus_per_node, memory_budget=budget, top=args.top,
        dtype=args.dtype, max_microbatch_size=args.max_microbatch_size,
        schedules=_schedules(args.schedules), partition=args.partition,
        allow_sequence_parallel=not args.no_sequence_parallel,
        allow_offload=not args.no_offload, tp_overlap=not args.no_tp_overlap,
        ep=_ep_sizes(args.ep), source=source,
        source_sha256=sha)


def _source(text: str) -> tuple[str, str | None]:
    """How the plan names the model for `stp train --model`: a preset as given, a
    config.json by its absolute path and sha256 (model_spec has read it)."""
    from stp.train.run.model_source import config_path, file_sha256, is_preset

    if is_preset(text):
        return text, None
    path = config_path(text).resolve()
    return str(path), file_sha256(path)


class ProgressLine:
    """The search's progress on a terminal, one line rewritten in place (module doc)."""

    def __init__(self, stream: Any, every_s: float = PROGRESS_EVERY_S) -> None:
        self.stream, self.every_s = stream, every_s
        self.start = self.last = time.monotonic()
        self.shown = False

    def __call__(self, result: PlanResult) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        best = "none fits yet" if result.best_s is None else f"best {result.best_s:.4g} s"
        # the time bound prunes what is left in the heap at the end: not known yet
        line = (f"plan: {result.considered} configurations, {result.pruned_memory} pruned "
                f"by their memory bound, {result.simulated} priced, {best}, "
                f"{now - self.start:.0f} s")
        self.stream.write("\r" + line + "\x1b[K")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _write_schedule_files(result: PlanResult, folder: str) -> None:
    """The schedule file of every row that runs from one (v != 2 chunks:
    `stp train` has no --chunks), beside the plan, named as its job names it."""
    from stp.files import write_text_atomic
    from stp.plan.report import schedule_file
    from stp.schedule import generate, validate
    from stp.schedule.io import dump_json

    for p in result.plans:
        name = schedule_file(p)
        if name is None:
            continue
        c = p.config
        sch = generate(c.schedule, c.mesh.pp, c.microbatches, **c.options())
        validate(sch)
        write_text_atomic(os.path.join(folder, name), dump_json(sch))


def run(args: argparse.Namespace) -> int:
    from stp.plan import NoPlan, plan
    from stp.plan.report import format_table, plan_json

    request = request_from_args(args)
    tty = not args.json and sys.stderr.isatty()
    line = ProgressLine(sys.stderr, PROGRESS_EVERY_S) if tty else None
    try:
        result = plan(request, line)
    except NoPlan as e:
        if line is not None:
            line.clear()
        print(f"stp: error: plan: {e}", file=sys.stderr)
        return EXIT_USAGE
    if line is not None:
        line.clear()
    folder = None if args.out is None else os.path.dirname(args.out)
    obj = plan_json(result, folder)
    if args.out is not None:
        from stp.files import write_text_atomic

        try:
            _write_schedule_files(result, folder or "")
            write_text_atomic(args.out, json.dumps(obj, indent=1) + "\n")
        except OSError as e:
            raise ValueError(f"--out {args.out!r}: cannot write: {e.strerror or e}") from None
    if args.json:
        print(json.dumps(obj))
    else:
        for line in format_table(result):
            print(line)
        if args.out is not None:
            print(f"wrote {args.out}: stp train --plan {args.out} runs plan #1")
    return 0
