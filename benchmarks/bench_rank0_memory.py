"""Peak host memory per rank at the end of a short `stp train`: does rank 0 hold more
than its share?

Before, every run ended with `Trainer.full_state_dict()` (the whole model
gathered on global rank 0) and rank 0 wrote it to `checkpoint.pt`. Now a run
ends with its sharded checkpoint, and `--save-full PATH` writes the whole model
as one safetensors file stage by stage (stp.train.checkpoint.save_full). This runs the
same short job three times on a pp x tp mesh (default pp2 x tp2, a 57M-parameter
float32 byte-level decoder: 8 layers, width 768):

    old default   the run, then what the old default did at its end (every rank
                  calls full_state_dict(), rank 0 torch.saves checkpoint.pt)
    new default   the run as it is now (sharded checkpoint only)
    --save-full   the run with --save-full PATH

and reports, per rank, its peak resident memory (VmHWM, the kernel's
high-water mark of the worker process) before the end (after the last step and
its sharded checkpoint) and at the end. Memory figures are exact on a loaded
machine; no timings are reported. Linux only (/proc/self/status).

    python3 benchmarks/bench_rank0_memory.py [--pp 2] [--tp 2] [--layers 8] [--hidden 768]
        [--steps 2] [--out benchmarks/results/rank0_memory.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

MIB = 2**20
MODES = ("old default", "new default", "--save-full")


def _hwm() -> int:
    """This process's peak resident bytes so far (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _worker(resolved: Any, mode: str) -> dict[str, Any]:
    """One rank of the run (started by stp.runtime.launch.launch_local)."""
    import torch
    import torch.distributed as dist

    from stp.runtime.launch import init_distributed
    from stp.train.run.loop import run
    from stp.train.step.trainer import Trainer

    marks: dict[str, int] = {}
    count, save_full = Trainer.parameter_count, Trainer.save_full

    def before_end(self: Trainer) -> None:  # first call: after the last checkpoint
        marks.setdefault("before_end", _hwm())

    def counting(self: Trainer) -> int:  # the place the old default gathered the model
        before_end(self)
        if mode == "old default":
            state = self.full_state_dict()
            if state is not None:
                torch.save({"model": state}, Path(resolved.job.out) / "checkpoint.pt")
            del state
        return count(self)

    def saving(self: Trainer, path: Any) -> None:
        before_end(self)
        save_full(self, path)

    Trainer.parameter_count, Trainer.save_full = counting, saving  # type: ignore[method-assign]
    init_distributed(timeout=resolved.job.timeout)
    summary = run(resolved)
    return {"rank": dist.get_rank(), "before_end": marks["before_end"], "end": _hwm(),
            "parameters": None if summary is None else summary.parameters}


def run_mode(job: Any, mode: str, out: Path) -> list[dict[str, Any]]:
    """Per-rank figures of one run of `job` in `mode`, its output in `out`."""
    from stp.runtime.launch import launch_local
    from stp.train.run.job import check

    job = dataclasses.replace(job, out=str(out), save_full=(
        str(out / "model.safetensors") if mode == "--save-full" else None))
    resolved = check(job)
    result = launch_local(_worker, (resolved, mode), job.world_size)
    if result.exitcode:
        raise SystemExit(f"{mode}: the run failed: {result.cause}")
    rows = [result.returns[r] for r in range(job.world_size)]
    for r, row in enumerate(rows):
        row["coord"] = resolved_coord(job, r)
    files = {p.name: p.stat().st_size for p in out.iterdir() if p.is_file()}
    rows[0]["files"] = files
    return rows


def resolved_coord(job: Any, rank: int) -> str:
    from stp.runtime.mesh import ParallelDims

    c = ParallelDims(job.pp, job.tp, job.dp).coord_of(rank)
    return f"pp{c.pp} tp{c.tp} dp{c.dp}"


def table(results: dict[str, list[dict[str, Any]]], job: Any) -> str:
    params = results["new default"][0]["parameters"]
    lines = [
        f"`stp train --pp {job.pp} --tp {job.tp} --layers {job.model.layers} --hidden "
        f"{job.model.hidden} --heads {job.model.heads} --seq-len {job.model.seq_len} "
        f"--microbatch-size {job.microbatch_size} -m {job.num_microbatches} --steps "
        f"{job.steps}` ({params:,} parameters, {job.dtype}: {params * 4 / MIB:,.0f} MiB of "
        "weights), peak resident memory (VmHWM) of each worker process in MiB, before the "
        "end of the run (after the last step and its sharded checkpoint) and at its end.",
        "",
        "| rank | " + " | ".join(f"{m}: before end | {m}: end" for m in MODES) + " |",
        "|---|" + "---:|" * (2 * len(MODES)),
    ]
    for r, row in enumerate(results[MODES[0]]):
        cells = []
        for m in MODES:
            got = results[m][r]
            cells += [f"{got['before_end'] / MIB:,.0f}", f"{got['end'] / MIB:,.0f}"]
        lines.append(f"| {r} ({row['coord']}) | " + " | ".join(cells) + " |")
    lines.append("")
    for m in MODES:
        ends = [row["end"] for row in results[m]]
        files = ", ".join(f"{n} {b / MIB:,.0f} MiB" for n, b in sorted(
            results[m][0]["files"].items()) if n.endswith((".pt", ".safetensors")))
        lines.append(f"- {m}: rank 0 ends at {ends[0] / MIB:,.0f} MiB, its TP peer (rank 1) "
                     f"at {ends[1] / MIB:,.0f} MiB; files besides the sharded checkpoint: "
                     f"{files or 'none'}")
    return "\n".join(lines) + "\n"


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as stp train does (shared cores)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "rank0_memory.md"))
    args = p.parse_args()

    from stp.train.run.config import ModelShape, TrainJob

    job = TrainJob(pp=args.pp, tp=args.tp, steps=args.steps, microbatches=2 * args.pp,
                   microbatch_size=1, timeout=600,
                   model=ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                    seq_len=64))
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-rank0-") as tmp:
        for k, mode in enumerate(MODES):
            results[mode] = run_mode(job, mode, Path(tmp) / f"run{k}")
            print(f"{mode}: done", flush=True)
    text = table(results, job)
    print(text)
    Path(args.out).write_text("# Peak host memory per rank at the end of `stp train`\n\n"
                              "`python3 benchmarks/bench_rank0_memory.py` (" +
                              "a 2-core machine shared with other jobs: memory figures are "
                              "exact, no timings are reported).\n\n" + text)


if __name__ == "__main__":
    main()
