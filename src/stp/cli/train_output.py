"""What `stp train` prints while it runs and when it ends: the progress line (or
--json's rows), the word while --compile compiles the first step, and the summary
with its `ran:` line (the configuration as it ran). stp.cli.train drives them."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from stp.cli.train_supervise import say
from stp.train.run.metrics import step_row

__all__ = ["Progress", "CompileProgress", "print_summary", "ran_line"]


class Progress:
    """Rank 0's step printer: JSON lines on stdout, or a bar on stderr."""

    def __init__(self, total: int, as_json: bool) -> None:
        self.total, self.as_json = total, as_json
        self.tty = sys.stderr.isatty()
        self.every = max(1, total // 20)
        self.first_figures: dict[str, float] | None = None
        self.last_figures: dict[str, float] | None = None

    def __call__(self, r: Any) -> None:
        if getattr(r, "startup", None) is not None:  # once, on stderr, --json or not
            from stp.train.run.startup import line

            print(line(r.startup), file=sys.stderr, flush=True)
        figures = getattr(r, "figures", None)
        if figures:  # for the summary: the first and the last step's
            self.first_figures = self.first_figures or figures
            self.last_figures = figures
        if self.as_json:
            row = step_row(r)  # what metrics.jsonl stores (stp.train.run.metrics)
            print(json.dumps(row), flush=True)
            return
        if r.skipped:
            print(f"step {r.step + 1}: gradients hold inf/NaN (norm {r.grad_norm}); update "
                  "skipped on every rank", file=sys.stderr, flush=True)
        done = r.step + 1
        width = 24
        fill = width * done // max(1, self.total)
        line = (f"step {done:>{len(str(self.total))}}/{self.total} "
                f"[{'=' * fill}{' ' * (width - fill)}] loss {r.loss:.4f} | "
                f"{r.tokens_per_s / 1000:.1f}k tok/s | {1000 * r.step_time_s:.0f} ms/step")
        line += "" if r.grad_norm is None else f" | grad {r.grad_norm:.3g} | lr {r.lr:.3g}"
        line += "" if getattr(r, "mfu", None) is None else f" | MFU {r.mfu:.1%}"
        line += "" if r.eval_loss is None else f" | eval {r.eval_loss:.4f}"
        line += _figures_text(figures)
        if r.eval_loss is not None and not self.tty:
            print(line, file=sys.stderr, flush=True)
            return
        if self.tty:  # "\x1b[K" clears what a longer earlier line left on the right
            end = "\n" if done == self.total else ""
            print("\r" + line + "\x1b[K", end=end, file=sys.stderr, flush=True)
        elif done % self.every == 0 or done in (1, self.total):
            print(line, file=sys.stderr, flush=True)


class CompileProgress:
    """Rank 0's word on --compile's first step, which compiles for seconds to minutes
    before it can report anything: on a terminal a line on stderr redrawn every
    `every_s` seconds with the time so far; off a terminal one line when it starts
    and one when it is done (a log gets no carriage returns). Called by the loop
    (stp.train.run.loop.run's on_compile): None at the start, the seconds at the end."""

    def __init__(self, tty: bool, every_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tty, self.every_s, self.clock = tty, every_s, clock
        self.start = 0.0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __call__(self, seconds: float | None) -> None:
        if seconds is None:
            self._begin()
        else:
            self._end(seconds)

    def _begin(self) -> None:
        self.start = self.clock()
        if not self.tty:
            say("compiling the model (--compile, first step) ...")
            return
        self.tick()
        self._ticker = threading.Thread(target=self._run, daemon=True, name="stp-compiling")
        self._ticker.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.tick()

    def tick(self) -> None:
        """Redraw the terminal line with the seconds so far."""
        spent = self.clock() - self.start
        os.write(2, f"\rcompiling the model (--compile, first step): {spent:.0f} s\x1b[K"
                 .encode())

    def _end(self, seconds: float) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        line = f"compiled in {seconds:.1f} s (--compile; the first step's time includes it)"
        say("\r" + line + "\x1b[K" if self.tty else line)


def _figures_text(figures: dict[str, float] | None) -> str:
    """An MoE step's figures for the progress line: the load-balancing loss and the
    busiest expert's share over the mean (1.00: balanced)."""
    if not figures or "aux_loss" not in figures:
        return ""
    return f" | aux {figures['aux_loss']:.4g} | load {figures.get('expert_load', 1.0):.2f}"


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _model_text(config: Any, parameters: int, job: Any) -> str:
    """The model as it ran: family, layers x width, parameters, an MoE's experts and
    its ep, a multimodal model's vision encoder (the family's words for it)."""
    from stp.cli.memory import format_count
    from stp.train.families import family_of

    if job.emulate is not None:
        return f"model emulated compute ({job.emulate} ms)"
    family = family_of(config)
    if family is None:
        raise ValueError(f"no model family builds a {type(config).__name__}")
    words = family.model.describe(config, params=format_count(parameters), ep=job.ep)
    return f"model {family.name} {words}"


def ran_line(s: Any, config: Any) -> str:
    """One line stating the configuration as it ran (s: stp.train.run.loop.RunSummary;
    config: the model's, stp.train.run.resolve.Run.config)."""
    job = s.job
    sp = job.sequence_parallel and job.tp > 1  # no effect at --tp 1
    chunks = job.tp_overlap_chunks if job.tp_overlap and sp else 0
    shard = job.shard_optimizer and job.dp > 1
    gather = job.overlap_param_gather and shard  # only with a sharded optimizer
    return (f"ran: pp{job.pp} tp{job.tp} dp{job.dp} schedule {job.schedule} "
            f"m{s.microbatches} mb{job.microbatch_size} seq {job.model.seq_len} | "
            f"{job.dtype} | sp {_on_off(sp)}"
            f"{f' | tp-overlap {chunks} chunks' if chunks else ''} | recompute {job.recompute} | "
            f"shard-optimizer {_on_off(shard)} | overlap grad-sync "
            f"{_on_off(job.overlap_grad_sync)}, param-gather {_on_off(gather)} | "
            f"offload {job.offload}{' | compile' if job.compile else ''}"
            f"{' | document-mask' if job.document_mask else ''} | "
            f"{_model_text(config, s.parameters, job)}")


def print_summary(s: Any, as_json: bool, config: Any = None,
             figures: tuple[dict[str, float] | None, dict[str, float] | None] = (None, None),
             ) -> None:
    """Rank 0's closing lines (s: stp.train.run.loop.RunSummary; config: the model's;
    figures: the first and the last step's MoE figures)."""
    job = s.job
    trained = len(s.step_times_s)
    first = job.steps - trained + 1
    text = (
        f"trained {trained} steps of {job.schedule} on pp={job.pp} tp={job.tp} "
        f"dp={job.dp} (m={s.microbatches}, {s.backend} on {s.device}, "
        f"{s.parameters:,} parameters)"
    )
    if config is not None:
        text += "\n" + ran_line(s, config)
    start, end = figures
    if end and "aux_loss" in end:
        text += (f"\nmoe: aux loss {start['aux_loss']:.4g} -> {end['aux_loss']:.4g}, "  # type: ignore[index]
                 f"expert load {end.get('expert_load', 1.0):.2f} in the last step (busiest "
                 "expert over the mean; 1.00 is balanced)")
    if first > 1:
        text += f"\nsteps {first}..{job.steps}, resumed after step {first - 1}"
    if job.partition is not None:
        text += f"\nlayers per global stage: {job.partition}"
    if job.emulate:
        text += f"\nemulated compute ({job.emulate} ms): the loss is not computed"
    elif s.first_loss is not None:
        text += (f"\nloss {s.first_loss:.4f} -> {s.last_loss:.4f}, "
                 f"{s.tokens_per_s / 1000:.1f}k tokens/s, "
                 f"{1000 * s.step_time_s:.0f} ms/step")
    if getattr(s, "compile_s", None) is not None:
        text += (f"\ncompiled (--compile): {s.compile_s:.1f} s compiling, inside the first "
                 "step (left out of the ms/step above)" if trained > 1 else
                 f"\ncompiled (--compile): {s.compile_s:.1f} s of the step compiling")
    if getattr(s, "mfu_line", None):
        text += f"\n{s.mfu_line}"
    if s.resident_activation_bytes:
        peaks = ", ".join(f"{b / 2**20:.2f}" for b in s.resident_activation_bytes)
        text += f"\npeak resident activations per rank (offload {job.offload}): {peaks} MiB"
    if job.trace:
        text += f"\ntrace of the last step: {job.trace}"
    if s.checkpoint:
        text += f"\ncheckpoint: {s.checkpoint} (sharded; continue with --resume {job.out})"
    if job.save_full:
        text += f"\nwhole model (safetensors): {job.save_full}"
    if job.save_hf:
        text += f"\nHugging Face checkpoint: {job.save_hf}"
    print(text, file=sys.stderr if as_json else sys.stdout, flush=True)
    if as_json and s.memory:  # after the step lines; no "loss" key, so readers of steps skip it
        from stp.train.run.loop import memory_summary

        compiled = {} if getattr(s, "compile_s", None) is None else {"compile_s": s.compile_s}
        sp = job.sequence_parallel and job.tp > 1
        overlap = {"tp_overlap": bool(job.tp_overlap and sp),
                   "tp_overlap_chunks": job.tp_overlap_chunks if job.tp_overlap and sp else 0}
        print(json.dumps({"summary": True, "steps": len(s.step_times_s), **compiled, **overlap,
                          "mfu": getattr(s, "mfu", None), **memory_summary(s.memory)}),
              flush=True)
