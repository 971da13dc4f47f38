"""The checks of a `stp train` (or `stp memory`) command line that need its flags
alone: no torch, no model, no file read.

Why a module of its own: the full checks (`stp.train.run.job.check`) import torch,
the models and the checkpoint code, which takes 5-20 s on a loaded machine
before a mistake such as `--tp 3` against 4 heads or a missing `--data` could be
named. `precheck(job)` runs first, in the launching process, and names such a
mistake in well under a second; whatever it lets through is checked again,
fully, by `stp.train.run.job`. Its messages are the ones the full checks give (the
full checks call the shared helpers here), so a refusal reads the same on either
path.
"""

from __future__ import annotations

from pathlib import Path

from stp.shapes import ModelConfig
from stp.train.data.detect import detect_format, parse_mixture
from stp.train.families.registry import EARLY_TP_CHECKS
from stp.train.run.config import DTYPES, TOY_SHAPE, TrainJob

__all__ = ["check_data_path", "check_mesh_flags", "precheck"]

def check_data_path(path: str) -> None:
    """ValueError naming `path` unless it exists (a text file or a directory)."""
    if not Path(path).exists():
        raise ValueError(f"data path {str(path)!r} does not exist; give a file or a directory")


def check_mesh_flags(job: TrainJob) -> None:
    """--ep against --dp, and --dtype (stp.train.run.job.check_plan's first checks)."""
    if job.dp % job.ep:
        raise ValueError(f"--ep {job.ep} must divide --dp {job.dp} (the expert-parallel "
                         "groups are carved from the data-parallel ranks)")
    if job.dtype not in DTYPES:
        raise ValueError(f"--dtype {job.dtype!r} not accepted; choose one of {', '.join(DTYPES)}")


def precheck(job: TrainJob) -> None:
    """ValueError (one line, naming the flag) for a mistake the flags alone show."""
    check_mesh_flags(job)
    if job.data is not None:  # each source of a mixture exists and fits --data-format
        for _, path in parse_mixture(job.data):
            detect_format(path, job.data_format)
    if job.eval_data is not None:
        check_data_path(job.eval_data)
    if job.init_from is not None and not Path(job.init_from).is_dir():
        # stp.models.hf.checkpoint's words, which the full checks give
        raise ValueError(f"checkpoint directory {str(job.init_from)!r} does not exist")
    if job.tokenizer is not None:
        p = Path(job.tokenizer)
        if not (p / "tokenizer.json" if p.is_dir() else p).is_file():
            raise ValueError(f"--tokenizer {job.tokenizer!r}: no tokenizer.json there")
    # --lr left out is resolved from the model's width (stp.train.run.config.default_lr)
    if job.lr is not None and job.lr_schedule != "constant" and job.min_lr > job.lr:
        raise ValueError(f"--min-lr {job.min_lr:g} is above --lr {job.lr:g}; give --min-lr <= --lr")
    _check_heads(job)


def _check_heads(job: TrainJob) -> None:
    """Heads, the MLP width and kv heads over --tp (the family's EARLY_TP_CHECKS), for a
    model whose shape is the flags' (not an --init-from checkpoint's, nor a resumed
    run's recorded one), in stp.models.decoder.stage.check_tp's order and words."""
    checks = EARLY_TP_CHECKS.get(job.arch, ())
    if not checks or job.init_from is not None or job.resume is not None:
        return
    m = job.model
    layers, hidden, heads = (getattr(m, k) or v for k, v in TOY_SHAPE.items())
    kv = m.kv_heads or heads
    try:  # the shape's own rules first, as the full checks meet them
        config = ModelConfig(vocab_size=256, hidden=hidden, num_layers=layers, num_heads=heads,
                             num_kv_heads=kv, max_seq_len=m.seq_len)
    except ValueError:
        return  # the full checks name it, in the flags' words
    if "heads" in checks and heads % job.tp:
        raise ValueError(f"--heads {heads} must be divisible by --tp {job.tp}")
    ffn = config.ffn_hidden or 0  # resolved by ModelConfig: never None here
    if "ffn" in checks and ffn % job.tp:
        raise ValueError(f"the MLP width (from --hidden) {config.ffn_hidden} must be divisible "
                         f"by --tp {job.tp}")
    if "kv_heads" in checks and kv % job.tp and job.tp % kv:
        raise ValueError(f"--kv-heads {kv} must be divisible by --tp {job.tp}, or divide it "
                         "(each kv head is then replicated on --tp / --kv-heads ranks)")
