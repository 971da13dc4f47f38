"""A training job: the settings of one `stp train` run, checked, and its loop.

`TrainJob` is plain data (picklable, sent to spawned workers). `check()`
refuses bad input before any process starts: mesh sizes, schedule and
microbatch count, model shape against tp and the number of stages, the
data path. `run(job, on_step)` trains on an initialised world and returns
a summary on global rank 0 (None elsewhere).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TrainJob", "StepReport", "run"]

DTYPES = ("float32", "float64", "bfloat16")


@dataclass(frozen=True)
class TrainJob:
    """Everything one training run needs; defaults are the `stp train` defaults."""

    schedule: str = "stp"
    pp: int = 2
    tp: int = 1
    dp: int = 1
    microbatches: int | None = None
    """m; None: 8, or more when the schedule's minimum or 2 pp is larger. A fixed
    default keeps the global batch, hence the losses, the same for pp = 1, 2, 4."""
    microbatch_size: int = 4
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None
    """None: as many as heads (plain multi-head attention)."""
    seq_len: int = 64
    steps: int = 200
    lr: float = 3e-3
    seed: int = 0
    dtype: str = "float32"
    data: str | None = None
    """A file or directory of text; None: the Python standard library's sources."""
    out: str | None = None
    """Checkpoint directory; None: runs/train-<time>/ under the working directory."""
    timeout: float = 120.0
    """Seconds a rank may wait on a receive or a collective before it gives up."""
    offload: str = "none"
    """Activation offload policy: none, stp, all, selective:X (stp.runtime.offload)."""
    braid: bool = True
    """Run braided blocks braided (stp.runtime.braid); False: the unbraided baseline."""
    trace: str | None = None
    """Write the last step's measured trace here (stp.runtime.trace), a JSON file."""
    emulate: str | None = None
    """Emulated compute `f=..,b=..,w=..` in ms (stp.runtime.emulate); None: the model."""

    # -- checks (no process started yet) -------------------------------------------

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def global_batch(self) -> int:
        """Sequences per step over all replicas: dp x m x microbatch size."""
        return self.dp * self.num_microbatches * self.microbatch_size

    @property
    def num_microbatches(self) -> int:
        from stp.schedule import registry

        spec = registry.get(self.schedule)
        if self.microbatches is not None:
            return self.microbatches
        return max(8, spec.min_microbatches(self.pp), 2 * self.pp)

    def model_config(self) -> Any:
        from stp.models import ModelConfig
        from stp.runtime.data import VOCAB_SIZE

        return ModelConfig(
            vocab_size=VOCAB_SIZE, hidden=self.hidden, num_layers=self.layers,
            num_heads=self.heads, num_kv_heads=self.kv_heads or self.heads,
            max_seq_len=self.seq_len, seed=self.seed,
        )

    def check(self, world_size: int | None = None) -> None:
        """ValueError naming the first bad setting and what would be accepted."""
        from stp.runtime.mesh import ParallelDims
        from stp.trainer import check_model, make_schedule

        dims = ParallelDims(self.pp, self.tp, self.dp)
        if world_size is not None:
            dims.check_world(world_size)
        if self.dtype not in DTYPES:
            raise ValueError(
                f"--dtype {self.dtype!r} not accepted; choose one of {', '.join(DTYPES)}"
            )
        for name in ("microbatch_size", "layers", "hidden", "heads", "seq_len"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout}")
        schedule = make_schedule(self.schedule, self.pp, self.num_microbatches)
        check_model(self.model_config(), self.tp, schedule.num_stages)
        from stp.schedule.offload import parse_policy

        parse_policy(self.offload)  # ValueError naming the accepted policies
        if self.emulate is not None:  # emulated compute: stp.runtime.emulate
            from stp.runtime.emulate import parse_emulate

            parse_emulate(self.emulate)
            if self.offload != "none":
                raise ValueError("--emulate-compute has no activations to offload; "
                                 "drop --offload or --emulate-compute")
        if self.trace is not None and not Path(self.trace).parent.is_dir():
            raise ValueError(f"--trace {self.trace!r}: directory "
                             f"{str(Path(self.trace).parent)!r} does not exist")
        if self.data is not None:
            from stp.runtime.data import read_corpus

            corpus = read_corpus(self.data)  # ValueError if missing or too small
            if len(corpus) < self.seq_len + 2:
                raise ValueError(
                    f"data {self.data!r} holds {len(corpus)} bytes, fewer than "
                    f"--seq-len + 2 = {self.seq_len + 2}"
                )

    def out_dir(self) -> Path:
        if self.out is not None:
            return Path(self.out)
        return Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class StepReport:
    step: int
    loss: float
    tokens_per_s: float
    step_time_s: float
    resident_activation_bytes: list[int] | None = None
    """Peak resident activation bytes of the step, per global rank."""


def run(
    job: TrainJob, on_step: Callable[[StepReport], None] | None = None
) -> dict[str, Any] | None:
    """Train `job` on the initialised world; `on_step` is called on global rank 0
    after every step. Returns the summary on rank 0 (after saving the
    checkpoint), None on the other ranks."""
    import torch
    import torch.distributed as dist

    from stp.runtime.data import ByteBatches, read_corpus
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.trainer import Trainer, make_schedule

    dims = ParallelDims(job.pp, job.tp, job.dp)
    mesh = Mesh.from_world(dims, timeout=job.timeout)
    dtype = getattr(torch, job.dtype)
    batches = ByteBatches.from_bytes(
        read_corpus(job.data), job.seq_len, job.global_batch, job.seed
    )
    lr = job.lr

    def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    schedule = make_schedule(job.schedule, job.pp, job.num_microbatches)
    model: Any = job.model_config()
    if job.emulate is not None:  # units wait instead of computing: stp.runtime.emulate
        from stp.runtime.emulate import emulated_builder, parse_emulate

        model = emulated_builder(parse_emulate(job.emulate), schedule.chunks, job.layers,
                                 job.hidden)
    trainer = Trainer(
        model, optimizer, schedule, mesh=mesh, dtype=dtype, timeout=job.timeout,
        offload=job.offload if job.emulate is None else None, hidden=job.hidden,
        braid=job.braid, trace=job.trace is not None,
    )
    tokens_per_step = job.global_batch * job.seq_len
    losses, times = [], []
    peaks: list[int] | None = None
    for step in range(job.steps):
        start = time.perf_counter()
        loss = trainer.step(batches.batch(step))
        elapsed = time.perf_counter() - start
        losses.append(loss)
        times.append(elapsed)
        resident = trainer.activation_peaks()  # collective, outside the timed step
        if resident is not None:
            old = peaks or resident
            peaks = [max(a, b) for a, b in zip(old, resident, strict=True)]
        if mesh.rank == 0 and on_step is not None:
            on_step(StepReport(step, loss, tokens_per_step / elapsed, elapsed, resident))
    if job.trace is not None and job.steps > 0:  # the last step, every rank
        trainer.write_trace(job.trace, {"braid": job.braid, "emulate": job.emulate,
                                        "tp": job.tp, "dp": job.dp})
    state = trainer.full_state_dict()
    if mesh.rank != 0:
        return None
    steady = times[1:] or times
    summary: dict[str, Any] = {
        "schedule": job.schedule, "pp": job.pp, "tp": job.tp, "dp": job.dp,
        "microbatches": schedule.num_microbatches, "steps": job.steps,
        "backend": str(dist.get_backend()), "device": str(mesh.device),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "tokens_per_s": tokens_per_step * len(steady) / sum(steady) if steady else None,
        "step_time_s": sum(steady) / len(steady) if steady else None,
        "parameters": sum(t.numel() for t in (state or {}).values()),
        "offload": job.offload,
        "resident_activation_bytes": peaks,
        "braid": job.braid, "trace": job.trace, "emulate": job.emulate,
    }
    out = job.out_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "checkpoint.pt"
    torch.save(
        {
            "model": state,
            "model_config": dataclasses.asdict(job.model_config()),
            "job": dataclasses.asdict(job),
            "losses": losses,
        },
        path,
    )
    summary["checkpoint"] = os.fspath(path)
    return summary
