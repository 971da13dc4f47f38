"""The single-device peer (stp.bench.plain_loop) and the per-step counts of stp's step
against it (stp.bench.single_device), issue 35."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stp.bench.plain_loop as plain_loop
from stp.bench.plain_loop import PlainModel, PlainShape, plain_step
from stp.bench.single_device import SingleSpec, time_sides
from stp.bench.step_counts import count_sides

SHAPE = PlainShape(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=256, seq_len=16)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


def test_plain_loop_is_written_without_stp_models():
    names = _imports(Path(plain_loop.__file__))
    assert "torch" in names  # the walk sees its imports
    assert not [n for n in names if n.startswith(("stp", "."))], names


def test_plain_step_accumulates_to_the_whole_batch_gradient():
    """Two microbatches of two sequences, each loss over m: the step's loss and norm are
    the whole batch's mean loss and the norm of its gradient, computed in one pass."""
    torch.manual_seed(0)
    model = PlainModel(SHAPE)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (4, 16))
    targets = torch.randint(0, 256, (4, 16))
    step, _ = plain_step(model, lr=1e-3, clip=1e9, compiled=False)
    loss, norm = step([(tokens[:2], targets[:2]), (tokens[2:], targets[2:])])
    whole = reference(tokens, targets)
    whole.backward()
    grads = [p.grad for p in reference.parameters()]
    assert loss == pytest.approx(whole.item(), rel=1e-5)
    assert norm == pytest.approx(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in grads])).item(), rel=1e-4)
    # and the update moved every weight matrix (AdamW ran)
    moved = [not torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(),
                                                   strict=True)]
    assert all(moved)


def test_plain_attention_is_causal_gqa_sdpa():
    """The block's attention against a hand-written one (repeated KV heads, masked
    softmax): the peer computes what stp's decoder computes, not something cheaper."""
    torch.manual_seed(1)
    model = PlainModel(SHAPE).double()
    block = model.blocks[0]
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    h = block.attn_norm(x)
    q = block.wq(h).view(2, 16, 4, 8).transpose(1, 2)
    k, v = block.wkv(h).view(2, 16, 2, 2, 8).permute(2, 0, 3, 1, 4)
    q, k = plain_loop._rotate(q, model.cos.double(), model.sin.double()), plain_loop._rotate(
        k, model.cos.double(), model.sin.double())
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    scores = scores.masked_fill(torch.ones(16, 16).triu(1).bool(), float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 32)
    x1 = x + block.wo(a)
    gate, up = block.w13(block.mlp_norm(x1)).chunk(2, dim=-1)
    expected = x1 + block.w2(F.silu(gate) * up)
    got = block(x, model.cos.double(), model.sin.double())
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def eager_counts():
    return count_sides(SingleSpec(), sides=("plain eager", "stp eager"))


def test_counts_see_the_plain_loops_one_host_read(eager_counts):
    """The counter against what the plain loop is known to do: one .tolist() a step,
    AdamW's 17 step counters (2 layers x 7 tensors, the embedding, the norm, the head)
    apart, an autograd node per op of the backward."""
    plain = eager_counts["plain eager"]
    assert plain["host syncs"] == 1 and plain["sync: .tolist()"] == 1
    assert plain["AdamW step-counter reads (host tensors, no sync)"] == 17
    assert plain["aten ops"] > 1000 and plain["autograd nodes"] > 100
    assert plain["compiled graph calls"] == 0


def test_stp_step_syncs_the_host_at_most_once(eager_counts):
    """Issue 35's target: the loss, grad norm and memory figures read once, at the end
    of the step (23 syncs a step before: token checks, per-microbatch losses, the
    memory gather at one rank, the clip norm)."""
    assert eager_counts["stp eager"]["host syncs"] <= 1


def test_stp_eager_aten_ops_within_1_1x_the_plain_loop(eager_counts):
    """Issue 35's target at the small CPU shape (5981 against 5051, 1.18x, before the
    one-rank embedding and cross-entropy and the CPU clip scale; 5444, 1.08x, after)."""
    stp, plain = eager_counts["stp eager"], eager_counts["plain eager"]
    assert stp["aten ops"] <= 1.1 * plain["aten ops"]


@pytest.mark.slow  # compiles both sides on the CPU: minutes
def test_stp_compiled_aten_ops_within_1_1x_the_compiled_plain_loop():
    """Issue 35's target, compiled against compiled (1900 against 1547, 1.23x, with the
    loss unit's four small graphs and the separate q/k/v and gate/up matmuls; 1416,
    0.92x, with the loss unit as one graph each way and those matmuls as one)."""
    counts = count_sides(SingleSpec(), sides=("plain compiled", "stp compiled"))
    stp, plain = counts["stp compiled"], counts["plain compiled"]
    assert plain["compiled graph calls"] > 0  # the plain side did run compiled
    assert stp["host syncs"] <= 1
    assert stp["aten ops"] <= 1.1 * plain["aten ops"]


def test_time_sides_on_the_cpu_reports_ratios_and_mfu():
    """The timing half at the small CPU shape, eager sides, one short round: every
    figure derived from the measured step time as documented."""
    got = time_sides(SingleSpec(), sides=("plain eager", "stp eager"), rounds=1, steps=1,
                     warmup=1, hardware="1e12")
    plain, stp = got["sides"]["plain eager"], got["sides"]["stp eager"]
    assert got["eager_ms_per_step_ratio"] == pytest.approx(stp["ms_per_step"]
                                                           / plain["ms_per_step"])
    for row in (plain, stp):
        step_s = row["ms_per_step"] / 1e3
        assert row["tokens_per_s"] == pytest.approx(4 * 2 * 64 / step_s)
        assert row["mfu"] == pytest.approx(got["step_flops"] / (step_s * 1e12))
        assert row["peak_bytes"] is None and row["resident_bytes"] > 0  # no allocator stats
