"""`stp train --arch decoder` (the default): stp's Llama / Qwen2-style decoder on
text, its shape from the flags (TOY_SHAPE where left out) or from an
`--init-from` Hugging Face checkpoint, its vocabulary the bytes or the
tokenizer's tokens."""

from __future__ import annotations

import re
from typing import Any

from stp.models.decoder.family import DECODER
from stp.schedule import Schedule
from stp.shapes import ModelConfig
from stp.train.data.corpus import VOCAB_SIZE, ByteBatches, read_corpus
from stp.train.data.load import data_options, open_data
from stp.train.data.tokens import Tokenizer, make_batches, tokenizer_vocab
from stp.train.families import RunInputs
from stp.train.run.config import TOY_SHAPE, TrainJob
from stp.train.run.pretrained import checkpoint_config

__all__ = ["FAMILY", "DecoderJob", "decoder_config", "in_flag_words"]

_FLAGS = {"hidden": "--hidden", "num_heads": "--heads", "num_kv_heads": "--kv-heads",
          "num_layers": "--layers", "max_seq_len": "--seq-len", "tp_size": "--tp",
          "ffn_hidden": "the MLP width (from --hidden)"}
_FIELD = re.compile(r"\b(?:ModelConfig\.|ModelConfig )?(" + "|".join(_FLAGS) + r")\b(=)?")


def in_flag_words(err: ValueError) -> ValueError:
    """`err` with the model's field names (`ModelConfig.hidden=30`, `tp_size=3`) said as
    the `stp train` flags a user gives (`--hidden 30`, `--tp 3`)."""
    def flag(m: re.Match[str]) -> str:
        return _FLAGS[m.group(1)] + (" " if m.group(2) else "")

    return ValueError(_FIELD.sub(flag, str(err)).replace("ModelConfig ", ""))


def decoder_config(job: TrainJob, tokenizer: Tokenizer | None) -> ModelConfig:
    """The decoder the shape flags describe (TOY_SHAPE where left out), its vocabulary
    the bytes or `tokenizer`'s tokens."""
    m = job.model
    layers, hidden, heads = (getattr(m, k) or v for k, v in TOY_SHAPE.items())
    vocab = VOCAB_SIZE if tokenizer is None else tokenizer_vocab(tokenizer.path)
    return ModelConfig(
        vocab_size=vocab, hidden=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=m.kv_heads or heads, max_seq_len=m.seq_len, seed=job.seed,
    )


class DecoderJob:
    name = "decoder"
    model = DECODER

    def check_flags(self, job: TrainJob) -> None:
        if job.images is not None:
            raise ValueError(f"--images {job.images!r} is image-caption data for --arch mllm; "
                             "for text give --data PATH")
        if job.eval_images is not None:
            raise ValueError(f"--eval-images {job.eval_images!r} is held-out images for --arch "
                             "mllm; for text give --eval-data PATH")
        if job.eval_every and job.eval_data is None:
            raise ValueError("--eval-every needs --eval-data PATH (held-out text)")

    def config(self, job: TrainJob, tokenizer: Tokenizer | None) -> ModelConfig:
        if job.init_from is not None:  # config.json and tensor headers checked
            return checkpoint_config(job.init_from, job.model)
        try:
            return decoder_config(job, tokenizer)
        except ValueError as e:
            raise in_flag_words(e) from None

    def check_run(self, job: TrainJob, config: ModelConfig, schedule: Schedule) -> None:
        try:
            self.model.check(config, job.tp, schedule.num_stages)
        except ValueError as e:
            raise in_flag_words(e) from None
        if job.sequence_parallel and job.tp > 1 and job.model.seq_len % job.tp:
            raise ValueError(f"--sequence-parallel splits the sequence over the TP ranks: "
                             f"--seq-len {job.model.seq_len} is not divisible by --tp {job.tp} "
                             "(stp refuses rather than pads)")

    def batches(self, run: RunInputs) -> Any:
        job = run.job
        return open_data(data_options(job), run.tokenizer, run.config.vocab_size,
                         job.model.seq_len, job.global_batch, job.seed).batches

    def eval_batches(self, run: RunInputs) -> Any | None:
        job = run.job
        if job.eval_data is None:
            return None
        if run.tokenizer is not None:
            return make_batches(job.eval_data, run.tokenizer, job.model.seq_len,
                                job.global_batch, job.seed)
        return ByteBatches.from_bytes(read_corpus(job.eval_data), job.model.seq_len,
                                      job.global_batch, job.seed)


FAMILY = DecoderJob()
