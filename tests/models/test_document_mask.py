"""Document masking against transformers run on each document alone.

A packed batch of documents of different lengths (the EOS id closes each; rows
start mid-document and end mid-document): with `document_eos`, stp's loss and
every parameter gradient equal the token-weighted mean of the loss of a
transformers Llama / Qwen2 run on each document piece by itself (positions from
0, nothing attending across documents, no target across a boundary), float64,
within 1e-9: on one process (the layer chunk at tp1), and at pp2 x tp2 with the
braided stp schedule, with and without sequence parallelism, full
recomputation on one of them (the recomputed attention masks the same)."""

from __future__ import annotations

from pathlib import Path

import _hf
import pytest
import torch
from _dist import run_dist
from transformers import AutoModelForCausalLM

from stp.models.hf.names import stp_name

F64 = torch.float64
TOL = 1e-9
EOS = 2  # both test configs' eos_token_id


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 rows of 16 tokens: documents of 1 to 11 tokens, an EOS at a row's start
    and at its end, one row of one document."""
    g = torch.Generator().manual_seed(7)
    stream = torch.randint(4, 96, (8 * 16 + 1,), generator=g)
    for at in (5, 9, 10, 21, 31, 32, 47, 50, 62, 80, 95, 111, 112, 127):
        stream[at] = EOS
    stream[96:112] = torch.randint(4, 96, (16,), generator=g)  # row 6: one piece
    tokens, targets = stream[:-1].view(8, 16), stream[1:].view(8, 16).clone()
    targets[3, 2:5] = -100  # ignored targets stay ignored
    return tokens, targets


def _reference(path: str) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers on each document piece alone; the mean over all valid targets."""
    model = _hf.float64_everywhere(AutoModelForCausalLM.from_pretrained(path, dtype=F64))
    tokens, targets = _batch()
    total, count = torch.zeros((), dtype=F64), 0
    for row in range(tokens.shape[0]):
        start = 0
        for end in range(tokens.shape[1]):
            if tokens[row, end] == EOS or end == tokens.shape[1] - 1:
                ids = tokens[row, start:end + 1][None]
                tgt = targets[row, start:end + 1].clone()
                if tokens[row, end] == EOS:
                    tgt[-1] = -100  # the next document's first token
                logits = model(input_ids=ids).logits[0]
                total = total + torch.nn.functional.cross_entropy(
                    logits, tgt, ignore_index=-100, reduction="sum")
                count += int((tgt != -100).sum())
                start = end + 1
    loss = total / count
    loss.backward()
    grads = {}
    for key, p in model.named_parameters():
        name = stp_name(key)
        if name is not None:
            grads[name] = p.grad
    return float(loss.detach()), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _step(trainer) -> tuple[float, dict[str, torch.Tensor]]:
    loss = trainer.step(_batch())
    return loss, trainer.full_state_dict(grads=True)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.0)


def _diffs(path: str, loss: float, grads: dict[str, torch.Tensor]) -> dict[str, float]:
    ref_loss, ref_grads = _reference(path)
    if "head.weight" in grads and "head.weight" not in ref_grads:  # tied
        ref_grads["head.weight"] = ref_grads["embed.weight"]
    assert sorted(grads) == sorted(ref_grads)
    return {"loss": abs(loss - ref_loss) / abs(ref_loss),
            "grad": max(_rel(grads[n], ref_grads[n]) for n in ref_grads)}


def test_one_process_equals_transformers_on_each_document(checkpoints: dict[str, Path]) -> None:
    from stp.train.step.trainer import Trainer

    for kind, path in checkpoints.items():
        trainer = Trainer(None, _sgd, "1f1b", microbatches=4, dtype=F64, timeout=60,
                          init_from=str(path), document_eos=EOS)
        diffs = _diffs(str(path), *_step(trainer))
        assert max(diffs.values()) < TOL, (kind, diffs)
        plain = Trainer(None, _sgd, "1f1b", microbatches=4, dtype=F64, timeout=60,
                        init_from=str(path))
        assert abs(plain.step(_batch()) - _reference(str(path))[0]) > 1e-3  # the mask matters


def _worker(rank: int, world: int, paths: dict[str, str], cases: list) -> dict:
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.step.trainer import Trainer

    mesh = Mesh.from_world(ParallelDims(2, 2, 1), timeout=60)
    out = {}
    for kind, sp, recompute in cases:
        trainer = Trainer(None, _sgd, "stp", mesh=mesh, microbatches=4, dtype=F64, timeout=60,
                          init_from=paths[kind], document_eos=EOS, sequence_parallel=sp,
                          recompute=recompute)
        loss, grads = _step(trainer)
        if rank == 0:
            out[(kind, sp, recompute)] = _diffs(paths[kind], loss, grads)
    return out


def test_pp2_tp2_braided_with_and_without_sp_equal_transformers(
        checkpoints: dict[str, Path]) -> None:
    paths = {k: str(v) for k, v in checkpoints.items()}
    cases = [("llama", True, "none"), ("qwen2", False, "full")]
    results = run_dist(_worker, 4, paths, cases, timeout=300)[0]
    assert len(results) == len(cases)
    for case, diffs in results.items():
        assert max(diffs.values()) < TOL, (case, diffs)


@pytest.mark.slow
def test_pp2_tp2_every_combination(checkpoints: dict[str, Path]) -> None:
    paths = {k: str(v) for k, v in checkpoints.items()}
    cases = [(k, sp, r) for k in paths for sp in (False, True)
             for r in ("none", "selective", "full")]
    results = run_dist(_worker, 4, paths, cases, timeout=600)[0]
    for case, diffs in results.items():
        assert max(diffs.values()) < TOL, (case, diffs)


@pytest.mark.parametrize("flags, message", [
    ([], "--document-mask needs tokenised data whose documents end in the EOS id"),
    (["--arch", "mllm"], "--arch mllm trains on one caption per image, with no documents"),
])
def test_document_mask_is_refused_in_one_line(flags: list[str], message: str,
                                              capsys: pytest.CaptureFixture) -> None:
    from stp.cli.main import main

    assert main(["train", "--pp", "1", "--steps", "1", "--document-mask", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_document_mask_refuses_compile_and_emulation() -> None:
    from stp.train.run.config import TrainJob
    from stp.train.run.job import check_document_mask

    with pytest.raises(ValueError, match="does not work with --compile yet"):
        check_document_mask(TrainJob(document_mask=True, compile=True), tokenised=True)
    with pytest.raises(ValueError, match="does not work with --emulate-compute yet"):
        check_document_mask(TrainJob(document_mask=True, emulate="f=1,b=1,w=1"), tokenised=True)
    check_document_mask(TrainJob(document_mask=True), tokenised=True)  # the rest runs


def test_a_mixture_of_experts_masks_documents_too() -> None:
    """The MoE stage's attention units take the tables as the decoder's do: rows
    without an EOS give the unmasked loss bit for bit, rows with one another loss."""
    from stp.shapes import MoEConfig
    from stp.train.step.trainer import Trainer

    moe = MoEConfig(vocab_size=32, hidden=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    ffn_hidden=64, max_seq_len=16, seed=3, init_std=0.2, num_experts=4,
                    top_k=2, expert_ffn=16, shared_expert_ffn=24, aux_loss_coef=0.0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 32, (8, 16), generator=g)
    targets = torch.roll(tokens, -1, 1)

    def loss(eos: int | None, tok: torch.Tensor) -> float:
        trainer = Trainer(moe, _sgd, "1f1b", microbatches=4, dtype=F64, document_eos=eos)
        return trainer.step((tok, targets))

    assert loss(EOS, tokens) == loss(None, tokens)  # no document ends: the causal mask
    packed = tokens.clone()
    packed[:, 5] = EOS
    assert abs(loss(EOS, packed) - loss(None, packed)) > 1e-3
