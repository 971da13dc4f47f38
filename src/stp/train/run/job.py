"""Checks of one `stp train` run (the settings: stp.train.run.config).

`check(job)` refuses bad input before any process starts and returns the run
it describes, resolved once (stp.train.run.resolve): mesh sizes, schedule and
microbatch count, model shape against tp and the number of stages, offload
and emulation settings, output paths, the data. Every failure is a
ValueError naming the flag and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

from stp.costmodel.peaks import check_hardware
from stp.models.emulated import parse_emulate
from stp.models.tp.overlap import check_chunks
from stp.runtime.mesh import ParallelDims
from stp.schedule.offload import parse_policy
from stp.train.checkpoint.checks import check_resume, check_writable
from stp.train.checkpoint.sharded import complete_checkpoints
from stp.train.checkpoint.storage import check_free_space, checkpoint_bytes
from stp.train.data.corpus import read_corpus
from stp.train.data.load import check_data
from stp.train.families import family_of
from stp.train.run.config import TrainJob
from stp.train.run.memory_check import check_memory
from stp.train.run.metrics import check_log
from stp.train.run.precheck import check_mesh_flags
from stp.train.run.pretrained import check_pretrained
from stp.train.run.resolve import Run, resolve

__all__ = ["check", "check_output_file", "check_plan", "model_config"]


def model_config(job: TrainJob) -> Any:
    """The model `job` trains (its config, stp.shapes), resolved from its flags."""
    return resolve(job).config


def check(job: TrainJob, world_size: int | None = None) -> Run:
    """The run `job` describes; ValueError naming the first bad setting and what
    would be accepted."""
    run = check_plan(job, world_size)
    check_pretrained(job, run.config, run.tokenizer)
    if job.trace is not None:
        check_output_file(job.trace, "--trace")
    if job.data is not None:
        check_data(job, run)
    if job.hardware is not None:
        check_hardware(job.hardware)
    check_log(job.log)
    if job.document_mask:
        check_document_mask(job, run.tokenizer is not None or job.eos_id is not None)
    _check_training(dataclasses.replace(job, lr=run.job.lr), run.config)  # --lr resolved
    if job.save_full is not None:  # after --out, which may be its directory, is made
        _check_save_full(job)
    check_memory(run, None if world_size is None else int(os.environ.get(
        "LOCAL_WORLD_SIZE", world_size)))  # before any worker allocates
    return run


def check_document_mask(job: TrainJob, tokenised: bool) -> None:
    """--document-mask: token data whose documents end in an EOS id, and a model
    and mode that take the mask (one line naming what to drop otherwise)."""
    if not tokenised:
        raise ValueError("--document-mask needs tokenised data whose documents end in the "
                         "EOS id: give --tokenizer PATH, --init-from a checkpoint with a "
                         "tokenizer, or --eos-id ID (byte-level data has no document ends)")
    refused = {"--compile": job.compile, "--emulate-compute": job.emulate is not None}
    for flag, given in refused.items():
        if given:
            raise ValueError(f"--document-mask does not work with {flag} yet; drop one of "
                             "them")


def _check_save_full(job: TrainJob) -> None:
    """--save-full: a file stp may write, of a model that has weights."""
    if job.emulate is not None:
        raise ValueError("--emulate-compute stages hold no model to save; drop --save-full "
                         "or --emulate-compute")
    check_output_file(str(job.save_full), "--save-full")  # called with --save-full given


def check_plan(job: TrainJob, world_size: int | None = None, config: object = None) -> Run:
    """The checks that read no data and write nothing (the mesh, the dtype, the
    resolved run, offload, emulation, sequence parallelism), and the run;
    `stp memory` prices a train command line after these. `config`: the model's,
    already read (stp.train.run.resolve.resolve)."""
    check_mesh_flags(job)  # --ep against --dp, --dtype (stp.train.run.precheck)
    dims = ParallelDims(job.pp, job.tp, job.dp, job.ep)
    if world_size is not None:
        dims.check_world(world_size)
    run = resolve(job, config)  # schedule, model (config.json checked), partition, tokenizer
    parse_policy(job.offload)  # ValueError naming the accepted policies
    if job.emulate is not None:
        parse_emulate(job.emulate)
        if job.partition is not None:
            raise ValueError("--emulate-compute times every stage's pass the same; drop "
                             "--partition or --emulate-compute")
        if job.offload != "none":
            raise ValueError("--emulate-compute has no activations to offload; "
                             "drop --offload or --emulate-compute")
        if job.recompute != "none":
            raise ValueError("--emulate-compute has no activations to recompute; "
                             "drop --recompute or --emulate-compute")
        if job.compile:
            raise ValueError("--emulate-compute has no model to compile; "
                             "drop --compile or --emulate-compute")
    if job.sequence_parallel and job.tp > 1:
        _check_sequence_parallel(job)
    if job.tp_overlap:
        _check_tp_overlap(job, run)
    if job.ep > 1:
        _check_expert_parallel(job, run)
    return run


def _check_expert_parallel(job: TrainJob, run: Run) -> None:
    """--ep > 1: a model with experts that split over the EP ranks (the family's)."""
    run.family.model.check_ep(run.config, job.ep)
    if job.emulate is not None:
        raise ValueError("--emulate-compute stages have no experts to dispatch; drop --ep "
                         "or --emulate-compute")


def _check_sequence_parallel(job: TrainJob) -> None:
    """--sequence-parallel on stages that have a sequence (whether it splits over the TP
    ranks is the family's check_run: its sequence is its own)."""
    if job.emulate is not None:
        raise ValueError("--emulate-compute stages have no sequence to shard; drop "
                         "--sequence-parallel or --emulate-compute")


def _check_tp_overlap(job: TrainJob, run: Run) -> None:
    """--tp-overlap cuts sequence parallelism's collectives: refused in one line where
    there are none to cut or where its chunks cannot run yet."""
    if not job.sequence_parallel:
        raise ValueError("--tp-overlap cuts the all-gather and reduce-scatter of sequence "
                         "parallelism: add --sequence-parallel")
    if job.tp < 2:
        return  # no effect at --tp 1, as --sequence-parallel
    if run.family.name != "decoder":
        raise ValueError(f"--tp-overlap runs on the decoder family only; --arch "
                         f"{run.family.name} is refused")
    check_chunks(job.model.seq_len, job.tp, job.tp_overlap_chunks)
    if job.compile:
        raise ValueError("--tp-overlap does not run with --compile yet (its chunks call the "
                         "linears one by one); drop one of them")
    if job.recompute == "full":
        raise ValueError("--tp-overlap does not run with --recompute full (its forward runs "
                         "again in B, unchunked); use --recompute selective or none")


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


def _check_training(job: TrainJob, config: Any) -> None:
    """Learning-rate schedule, evaluation, resume and --out (created, written to)."""
    if job.lr_schedule != "constant" and job.lr is not None and job.min_lr > job.lr:
        raise ValueError(f"--min-lr {job.min_lr:g} is above --lr {job.lr:g}; give --min-lr <= --lr")
    if job.eval_data is not None and len(read_corpus(job.eval_data)) < job.model.seq_len + 2:
        raise ValueError(f"--eval-data {job.eval_data!r} is shorter than --seq-len + 2 bytes")
    if job.resume is not None:
        model = None if job.emulate else dataclasses.asdict(config)
        check_resume(job.resume, model, allow_unverified=job.allow_unverified)
    if job.out is not None:  # the default is a new directory, created when chosen
        held = complete_checkpoints(job.out)
        if held and job.resume is None:
            raise ValueError(f"--out {job.out!r} holds another run's checkpoints "
                             f"({held[-1].name}); continue it with --resume {job.out}, or give "
                             "another --out")
        check_writable(job.out)
        family = family_of(config)  # None: a user's stage builder, not sized up front
        if family is not None:
            params = family.model.parameter_count(config)
            check_free_space(job.out, checkpoint_bytes(params, job.dtype))
