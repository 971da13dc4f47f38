"""Checks and model of one `stp train` run (the settings: stp.train.config).

`check(job)` refuses bad input before any process starts: mesh sizes,
schedule and microbatch count, model shape against tp and the number of
stages, offload and emulation settings, output paths, the data. Every
failure is a ValueError naming the flag and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from stp.models import ModelConfig, check_model
from stp.models.emulated import emulated_builder, parse_emulate
from stp.models.mllm_config import MLLMConfig
from stp.runtime.mesh import ParallelDims
from stp.schedule import Schedule
from stp.schedule.offload import parse_policy
from stp.train.checkpoint import check_resume, check_writable
from stp.train.config import DTYPES, TOY_SHAPE, TrainJob
from stp.train.data import VOCAB_SIZE, open_corpus, read_corpus
from stp.train.mllm_job import check_mllm_job, mllm_config
from stp.train.plan import job_partition, job_schedule
from stp.train.pretrained import check_pretrained, checkpoint_config, job_tokenizer
from stp.train.storage import check_free_space, checkpoint_bytes
from stp.train.tokens import tokenizer_vocab

__all__ = ["check", "model_config", "make_schedule", "stage_model"]


def model_config(job: TrainJob) -> Any:
    """The model to train: --init-from's config.json (stp.train.pretrained), else stp's
    own decoder from the shape flags (TOY_SHAPE where left out), its vocabulary the
    bytes or the --tokenizer's tokens. With --arch mllm, an MLLMConfig: a vision
    encoder in front of that decoder (stp.train.mllm_job)."""
    if job.init_from is not None:
        return checkpoint_config(job)
    m = job.model
    layers, hidden, heads = (getattr(m, k) or v for k, v in TOY_SHAPE.items())
    found = job_tokenizer(job)
    vocab = VOCAB_SIZE if found is None else tokenizer_vocab(found[0])
    config = ModelConfig(
        vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=m.kv_heads or heads, max_seq_len=m.seq_len, seed=job.seed,
    )
    return mllm_config(job, config) if job.arch == "mllm" else config


def make_schedule(job: TrainJob) -> Schedule:
    """The registry's schedule of the name, or the schedule file (stp.train.plan)."""
    return job_schedule(job)


def stage_model(job: TrainJob, schedule: Schedule) -> Any:
    """What the Trainer builds stages from: the model's config, or emulated stages
    (units that wait instead of computing: stp.models.emulated)."""
    config = model_config(job)
    if job.emulate is None:
        return config
    return emulated_builder(parse_emulate(job.emulate), schedule.chunks, config.num_layers,
                            config.hidden)


def check(job: TrainJob, world_size: int | None = None) -> None:
    """ValueError naming the first bad setting and what would be accepted."""
    dims = ParallelDims(job.pp, job.tp, job.dp)
    if world_size is not None:
        dims.check_world(world_size)
    if job.dtype not in DTYPES:
        raise ValueError(f"--dtype {job.dtype!r} not accepted; choose one of {', '.join(DTYPES)}")
    schedule = make_schedule(job)  # a name, or a file checked against the mesh
    config = model_config(job)  # with --init-from: config.json and tensor headers checked
    if isinstance(config, MLLMConfig):  # --arch mllm: vision encoder + decoder
        check_mllm_job(job, config, schedule)
    else:
        check_model(config, job.tp, schedule.num_stages)
    job_partition(job, config, schedule)  # layers per stage: one per stage, summing right
    check_pretrained(job, config)
    parse_policy(job.offload)  # ValueError naming the accepted policies
    if job.emulate is not None:
        parse_emulate(job.emulate)
        if job.partition is not None:
            raise ValueError("--emulate-compute times every stage's pass the same; drop "
                             "--partition or --emulate-compute")
        if job.offload != "none":
            raise ValueError("--emulate-compute has no activations to offload; "
                             "drop --offload or --emulate-compute")
    if job.trace is not None:
        check_output_file(job.trace, "--trace")
    if job.data is not None:
        size = open_corpus(job.data).size  # ValueError if missing or too small; reads no data
        if size < job.model.seq_len + 2:
            raise ValueError(
                f"data {job.data!r} holds {size} bytes, fewer than "
                f"--seq-len + 2 = {job.model.seq_len + 2}"
            )
    _check_training(job)


def check_output_file(path: str, flag: str) -> None:
    """ValueError unless file `path` can be written: its directory exists and takes a
    new file (probed by creating one: permission bits say nothing to root or on a
    read-only filesystem) and the path is not a directory. Checked before the work
    that would end by writing it."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path!r} is a directory; give a file name")
    if not p.parent.is_dir():
        raise ValueError(f"{flag} {path!r}: directory {str(p.parent)!r} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=p.parent, prefix=".stp-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot write in {str(p.parent)!r}: "
                         f"{e.strerror or e}") from None


def _check_training(job: TrainJob) -> None:
    """Learning-rate schedule, evaluation, resume and --out (created, written to)."""
    if job.lr_schedule != "constant" and job.min_lr > job.lr:
        raise ValueError(f"--min-lr {job.min_lr:g} is above --lr {job.lr:g}; give --min-lr <= --lr")
    if job.images is not None and job.arch != "mllm":
        raise ValueError(f"--images {job.images!r} is image-caption data for --arch mllm; "
                         "for text give --data PATH")
    if job.eval_images is not None and job.arch != "mllm":
        raise ValueError(f"--eval-images {job.eval_images!r} is held-out images for --arch mllm; "
                         "for text give --eval-data PATH")
    # --arch mllm evaluates on held-out images (stp.train.mllm_job checks them)
    if job.eval_every and job.eval_data is None and job.arch != "mllm":
        raise ValueError("--eval-every needs --eval-data PATH (held-out text)")
    if job.eval_data is not None and len(read_corpus(job.eval_data)) < job.model.seq_len + 2:
        raise ValueError(f"--eval-data {job.eval_data!r} is shorter than --seq-len + 2 bytes")
    if job.resume is not None:
        model = None if job.emulate else dataclasses.asdict(model_config(job))
        check_resume(job.resume, model)
    if job.out is not None:  # the default is a new directory, created when chosen
        check_writable(job.out)
        check_free_space(job.out, checkpoint_bytes(model_config(job), job.dtype))
