"""`stp train` with a Hugging Face checkpoint: --init-from, --save-hf, --tokenizer.

Everything here runs before any worker starts (`check_pretrained`, called by
stp.train.run.job.check) or is a cheap re-read in each worker: the checkpoint's
config.json and safetensors headers (never the weights), the tokenizer file.
A model-shape flag given with --init-from must agree with the checkpoint;
one left out takes the checkpoint's value.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stp.shapes import ModelConfig
from stp.train.data.tokens import (
    TokenBatches,
    Tokenizer,
    TokenStream,
    find_tokenizer,
    tokenize,
    tokenizer_vocab,
)
from stp.train.run.config import ModelShape, TrainJob

__all__ = ["checkpoint_config", "check_pretrained", "config_json_config", "copy_tokenizer"]

# ModelShape field -> (ModelConfig field, what config.json calls it)
_SHAPE_FLAGS = {
    "layers": ("num_layers", "num_hidden_layers"),
    "hidden": ("hidden", "hidden_size"),
    "heads": ("num_heads", "num_attention_heads"),
    "kv_heads": ("num_kv_heads", "num_key_value_heads"),
}


def checkpoint_config(init_from: str, shape: ModelShape) -> ModelConfig:
    """The model of --init-from DIR: config.json, checked against the weights' headers
    and against the model-shape flags given in `shape` (ValueError naming the path or
    flag)."""
    from stp.models.hf import HFCheckpoint

    return _agreeing(HFCheckpoint.open(init_from).config, init_from, shape)


def config_json_config(init_from: str, shape: ModelShape) -> ModelConfig:
    """The model of --init-from DIR from its config.json alone (the weights neither
    read nor required: `stp memory` sizes a model before it is downloaded), checked
    against the model-shape flags as `checkpoint_config` does."""
    from stp.files import read_json_object
    from stp.models.hf.config import config_from_hf

    path = Path(init_from) / "config.json"
    if not Path(init_from).is_dir():
        raise ValueError(f"--init-from {init_from!r}: no such directory")
    if not path.is_file():
        raise ValueError(f"--init-from {init_from!r}: {path} is missing (a Hugging Face "
                         "checkpoint directory holds config.json)")
    return _agreeing(config_from_hf(read_json_object(path), str(path)), init_from, shape)


def _agreeing(config: ModelConfig, init_from: str, shape: ModelShape) -> ModelConfig:
    """`config`, once the model-shape flags given agree with it."""
    for flag, (field, hf) in _SHAPE_FLAGS.items():
        given = getattr(shape, flag)
        if given is not None and given != getattr(config, field):
            raise ValueError(
                f"--{flag.replace('_', '-')} {given} contradicts the checkpoint "
                f"{init_from!r} ({hf}={getattr(config, field)} in its config.json); "
                f"drop --{flag.replace('_', '-')}"
            )
    if shape.seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {shape.seq_len} exceeds the checkpoint's "
                         f"max_position_embeddings={config.max_seq_len}")
    return config


def _check_save_dir(job: TrainJob, save_hf: str) -> None:
    out = Path(save_hf)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--save-hf {job.save_hf!r} is a file; give a directory")
    if job.init_from is not None and out.resolve() == Path(job.init_from).resolve():
        raise ValueError(f"--save-hf {job.save_hf!r} is the --init-from directory; "
                         "give another directory")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--save-hf {job.save_hf!r}: cannot write in {str(parent)!r}")


def check_pretrained(job: TrainJob, config: ModelConfig, found: Tokenizer | None) -> None:
    """The checks of --init-from, --save-hf and --tokenizer (`found`: the run's
    tokenizer) before any worker starts; tokenises --data (and --eval-data) into the
    cache the workers then read."""

    if job.init_from is not None and job.emulate is not None:
        raise ValueError("--emulate-compute does not compute: drop --init-from or "
                         "--emulate-compute")
    if job.save_hf is not None:
        _check_save_dir(job, job.save_hf)
    if job.init_from is not None:  # NaN/inf weights: one line now, before any worker starts
        from stp.models.hf import HFCheckpoint
        from stp.train.step.finite import scan_hf

        scan_hf(HFCheckpoint.open(job.init_from))
    if found is None:
        if job.init_from is not None:  # its token ids mean its tokenizer's tokens, not bytes
            raise ValueError(f"--init-from {job.init_from!r} has no tokenizer.json: a pretrained "
                             "model's ids are its tokenizer's tokens, not bytes; give "
                             "--tokenizer PATH (a tokenizer.json or the directory holding one)")
        return
    vocab = tokenizer_vocab(found.path)
    if vocab > config.vocab_size:
        raise ValueError(f"tokenizer {str(found.path)!r} has {vocab} tokens, more than the "
                         f"model's vocab_size={config.vocab_size}")
    # a --data given is opened in its own format by stp.train.data.load.check_data
    texts = [None] if job.data is None else []
    for data in texts + ([job.eval_data] if job.eval_data is not None else []):
        stream = TokenStream(tokenize(data, found.path, found.eos))
        TokenBatches(stream, job.model.seq_len, job.global_batch)  # ValueError: too short


def copy_tokenizer(tokenizer: str | None, save_hf: str | None) -> None:
    """Put --tokenizer's files into the --save-hf directory (the model was trained on
    its ids), next to whatever the --init-from checkpoint brought."""
    if tokenizer is None or save_hf is None:
        return
    from stp.models.hf import TOKENIZER_FILES

    found = find_tokenizer(tokenizer, None)
    assert found is not None
    shutil.copyfile(found, Path(save_hf) / "tokenizer.json")
    for name in TOKENIZER_FILES[1:]:
        if name != "generation_config.json" and (found.parent / name).is_file():
            shutil.copyfile(found.parent / name, Path(save_hf) / name)
