"""A ranked plan as a user reads it: figures, the `stp train` flags, and why.

Each row carries the `stp train` flags that run it (`train_flags`) and the
same settings as `TrainJob` field names (`job`), which `stp train --plan`
reads. `stp train` has no `--chunks`: a row at v != 2 chunks per rank runs
from a schedule file instead (`stp export ... --chunks v --format json`,
then `stp train --schedule FILE.json`); the row names the file and the
export command (`schedule_file`, `export_flags`), and `stp plan --out`
writes the files beside the plan. `why` compares the best with the
runner-up part by part: the busiest rank's compute, its idle time
(pipeline bubbles), the TP collectives it waits for, and the DP gradient
sync.
"""

from __future__ import annotations

import os
import shlex

from stp.costmodel.memory import format_bytes
from stp.plan.experts import is_moe
from stp.plan.planner import PlanResult
from stp.plan.price import Priced, model_flops_per_sequence

__all__ = ["row_json", "plan_json", "why", "format_table", "train_flags", "job_fields",
           "schedule_file", "export_flags"]

PLAN_FORMAT = 2
"""Version of the `--out PLAN.json` layout `stp train --plan` reads: 2 records the
model (`model`, and each job's `model_name`, `stp train --model`); 1 did not."""


def schedule_file(p: Priced) -> str | None:
    """The schedule file a row at v != 2 chunks runs from (module doc); None
    when `stp train --schedule NAME` runs it."""
    c = p.config
    if c.chunks is None or c.chunks == 2:
        return None
    return f"{c.schedule}-p{c.mesh.pp}-m{c.microbatches}-v{c.chunks}.json"


def export_flags(p: Priced, path: str) -> list[str]:
    """`stp export` flags that write the schedule file of `schedule_file`."""
    c = p.config
    return ["--schedule", c.schedule, "--pp", str(c.mesh.pp), "-m", str(c.microbatches),
            "--chunks", str(c.chunks), "--format", "json", "--out", path]


def job_fields(p: Priced, seq_len: int, schedule_path: str | None = None,
               model: str | None = None) -> dict[str, object]:
    """The `stp train` settings of a plan, as `TrainJob` field names. Levers
    left off are left out, so a build without them still runs the plan.
    `schedule_path`: where the row's schedule file is (default its bare
    `schedule_file` name), for a row that needs one; `model`: the model's
    `--model` text (`PlanRequest.source`), first."""
    c, f = p.config, p.config.features
    sched = schedule_file(p)
    out: dict[str, object] = {} if model is None else {"model_name": model}
    out |= {
        "pp": c.mesh.pp, "tp": c.mesh.tp, "dp": c.mesh.dp,
        "schedule": c.schedule if sched is None else (schedule_path or sched),
        "microbatches": c.microbatches, "microbatch_size": c.microbatch_size,
        "seq_len": seq_len, "dtype": f.dtype,
    }
    if c.mesh.ep > 1:  # a mixture of experts' expert parallelism (`stp train --ep`)
        out["ep"] = c.mesh.ep
    if p.partition is not None:
        out["partition"] = ",".join(map(str, p.partition))
    if f.sequence_parallel:
        out["sequence_parallel"] = True
    if f.recompute != "none":
        out["recompute"] = f.recompute
    if f.shard_optimizer:
        out["shard_optimizer"] = True
    if f.offload != "none":
        out["offload"] = f.offload
    if not f.braid:
        out["braid"] = False
    if f.tp_overlap_chunks:
        out["tp_overlap"] = True
        out["tp_overlap_chunks"] = f.tp_overlap_chunks
    return out


def train_flags(job: dict[str, object]) -> list[str]:
    """`stp train` flags of `job_fields` (-m for microbatches, --model for the
    model's name, bare for on)."""
    out: list[str] = []
    for key, val in job.items():
        flag = {"microbatches": "-m", "model_name": "--model"}.get(
            key, "--" + key.replace("_", "-"))
        out += [flag] if val is True else [flag, "off"] if val is False else [flag, str(val)]
    return out


def _figures(p: Priced, result: PlanResult) -> dict[str, float]:
    req = result.request
    tokens = req.global_batch * req.seq_len
    flops = req.global_batch * model_flops_per_sequence(req.model, req.seq_len)
    return {
        "step_time_s": p.step_s,
        "tokens_per_s_per_gpu": tokens / p.step_s / req.gpus,
        "mfu": flops / (p.step_s * req.gpus * req.hardware.peak_flops),
    }


def row_json(p: Priced, result: PlanResult, schedule_path: str | None = None
             ) -> dict[str, object]:
    c = p.config
    job = job_fields(p, result.request.seq_len, schedule_path, result.request.source)
    sched = schedule_file(p)
    extra: dict[str, object] = {} if sched is None else {
        "schedule_file": schedule_path or sched,
        "export_flags": export_flags(p, schedule_path or sched)}
    ep = {"ep": c.mesh.ep} if is_moe(result.request.model) else {}
    return {
        "pp": c.mesh.pp, "tp": c.mesh.tp, "dp": c.mesh.dp, **ep, "schedule": c.schedule,
        "chunks": p.result.schedule.chunks,
        "microbatch_size": c.microbatch_size, "microbatches": c.microbatches,
        **_figures(p, result),
        "pipeline_s": p.pipeline_s, "dp_sync_s": p.dp_sync_s,
        "peak_bytes": p.peak_bytes, "peak_rank": p.estimate.peak.rank,
        "sequence_parallel": c.features.sequence_parallel,
        "recompute": c.features.recompute, "shard_optimizer": c.features.shard_optimizer,
        "offload": c.features.offload,
        "tp_overlap_mode": p.result.mode, "tp_overlap_chunks": c.features.tp_overlap_chunks,
        "partition": list(p.partition) if p.partition is not None else None,
        "flags": train_flags(job), "job": job, **extra,
    }


def _parts(p: Priced) -> dict[str, float]:
    """Seconds of the step by part, on the rank that ends last."""
    crit = p.result.critical_rank
    return {"compute": crit.compute / 1e3, "pipeline idle": crit.idle / 1e3,
            "exposed TP communication": crit.exposed_tp / 1e3,
            "exposed all-to-all": crit.exposed_a2a / 1e3, "DP gradient sync": p.dp_sync_s}


def _name(p: Priced) -> str:
    c = p.config
    v = f" v{c.chunks}" if c.chunks is not None else ""
    ep = f" ep{c.mesh.ep}" if c.mesh.ep > 1 else ""
    return (f"pp{c.mesh.pp} tp{c.mesh.tp} dp{c.mesh.dp}{ep} {c.schedule}{v} "
            f"b{c.microbatch_size} m{c.microbatches}")


def why(best: Priced, runner: Priced | None, result: PlanResult | None = None) -> str:
    """One sentence: by how much the best beats the runner-up, and where; with
    no runner-up (`--top 1`), how many were priced that fit (`result`)."""
    if runner is None:
        fitted = result.fitted if result is not None else 1
        if fitted <= 1 and (result is None or result.pruned_time == 0):
            return f"{_name(best)} is the only configuration that fits"
        return (f"{_name(best)} is the best of {fitted} priced configurations that fit"
                + (f" ({result.pruned_time} more left unpriced: their time bound was "
                   "past it)" if result is not None and result.pruned_time else ""))
    gap = runner.step_s - best.step_s
    a, b = _parts(best), _parts(runner)
    diffs = sorted(a, key=lambda k: a[k] - b[k])  # the most in the best's favour first
    told = [f"{k} {a[k]:.4g} s vs {b[k]:.4g} s" for k in diffs[:2] if b[k] - a[k] > 1e-12]
    where = "; ".join(told) if told else "the same parts, a shorter critical path"
    return (f"{_name(best)} beats {_name(runner)} by {gap:.4g} s "
            f"({gap / runner.step_s:.1%} of its step): {where}")


def plan_json(result: PlanResult, schedule_dir: str | None = None) -> dict[str, object]:
    """`schedule_dir`: where the rows' schedule files are written (`--out`'s
    folder), named in their jobs; None: bare file names."""
    req = result.request
    rows = [row_json(p, result, None if schedule_dir is None or schedule_file(p) is None
                     else os.path.join(schedule_dir, schedule_file(p) or ""))
            for p in result.plans]
    model: dict[str, object] | None = None
    if req.source is not None:
        model = ({"preset": req.source} if req.source_sha256 is None
                 else {"config": req.source, "sha256": req.source_sha256})
    return {
        "format": PLAN_FORMAT,
        **({"model": model} if model is not None else {}),
        "request": {"model": req.model.name, "gpus": req.gpus, "gpus_per_node": req.gpus_per_node,
                    "global_batch": req.global_batch, "seq_len": req.seq_len,
                    "hardware": req.hardware.name, "memory_budget": req.budget,
                    # what in-layer overlap was priced with (`stp plan --calibrate` measures it)
                    "gemm_rows": [list(p) for p in req.hardware.gemm_rows],
                    "tp_chunk_launch": req.hardware.tp_chunk_launch,
                    **({"ep": list(req.ep)} if req.ep is not None else {})},
        "plans": rows,
        "why": why(result.plans[0], result.plans[1] if len(result.plans) > 1 else None,
                   result),
        "search": {"considered": result.considered, "pruned_memory": result.pruned_memory,
                   "pruned_time": result.pruned_time, "simulated": result.simulated,
                   "skipped_rungs": result.skipped_rungs, "fitted": result.fitted,
                   "seconds": result.seconds},
    }


def format_table(result: PlanResult) -> list[str]:
    """The top plans, one line each, then their flags and the comparison."""
    header: tuple[str, ...] = ("#", "pp", "tp", "dp", "schedule", "v", "b", "m", "levers", "step s",
              "tok/s/GPU", "MFU", "peak", "rank")
    rows: list[tuple[str, ...]] = []
    for i, p in enumerate(result.plans, 1):
        c, f, fig = p.config, p.config.features, _figures(p, result)
        levers = ",".join(x for x in (
            "sp" if f.sequence_parallel else "", f"rc={f.recompute}" if f.recompute != "none"
            else "", "zero1" if f.shard_optimizer else "",
            f"off={f.offload}" if f.offload != "none" else "",
            "nobraid" if not f.braid else "",
            f"tpo={f.tp_overlap_chunks}" if f.tp_overlap_chunks else "",
            "part" if p.partition is not None else "") if x) or "-"
        rows.append((str(i), str(c.mesh.pp), str(c.mesh.tp), str(c.mesh.dp), c.schedule,
                     str(p.result.schedule.chunks), str(c.microbatch_size),
                     str(c.microbatches), levers,
                     f"{fig['step_time_s']:.4g}", f"{fig['tokens_per_s_per_gpu']:.4g}",
                     f"{fig['mfu']:.1%}", format_bytes(p.peak_bytes), str(p.estimate.peak.rank)))
    if is_moe(result.request.model):  # the expert-parallel axis beside dp
        header = (*header[:4], "ep", *header[4:])
        rows = [(*r[:4], str(p.config.mesh.ep), *r[4:]) for r, p in zip(rows, result.plans,
                                                                      strict=True)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for i, p in enumerate(result.plans, 1):
        sched = schedule_file(p)
        train = "stp train " + shlex.join(train_flags(job_fields(
            p, result.request.seq_len, model=result.request.source)))
        if sched is None:
            lines.append(f"#{i}: {train}")
        else:
            lines.append(f"#{i}: stp train has no --chunks; v={p.config.chunks} runs from a "
                         f"schedule file: stp export {' '.join(export_flags(p, sched))} && "
                         f"{train}")
    lines.append("why: " + why(result.plans[0],
                               result.plans[1] if len(result.plans) > 1 else None, result))
    r = result
    lines.append(f"searched {r.considered} configurations in {r.seconds:.1f} s: "
                 f"{r.pruned_memory} ruled out by their memory bound, {r.pruned_time} by "
                 f"their time bound, {r.simulated} simulated ({r.skipped_rungs} lever rungs "
                 "passed over by the exact memory bound)")
    return lines
