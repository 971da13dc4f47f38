"""stp.costmodel.memory: the cases the other costmodel tests never set up.

Written to kill mutants mutmut left alive in stp/costmodel/memory.py (docs/testing.md).
The reference is a hand count of the formulas the module docstring (and
docs/memory.md) states: bytes per parameter by category, the receive and
all-to-all buffers in `s b h` values, one TP shard of a layer. Each test names
the bug it guards against.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from stp.costmodel import parse_hardware
from stp.costmodel.decoder.memory import _rank, memory_of_run, rank_parameters
from stp.costmodel.decoder.spec import ModelSpec
from stp.costmodel.memory import Features, Layout, RankMemory, estimate, estimate_run, format_bytes
from stp.costmodel.moe.spec import MoESpec

HW = parse_hardware("a100-80g")
S, B, H = 16, 3, 64
DENSE = ModelSpec(layers=4, hidden=H, heads=8, kv_heads=2, ffn=96, vocab=101, sequence=S,
                  micro_batch=B)
MOE = MoESpec(layers=4, hidden=H, heads=8, kv_heads=2, ffn=96, vocab=101, sequence=S,
              micro_batch=B, experts=4, top_k=2, expert_ffn=32, ep=2)


def _values(width: int) -> int:
    """Bytes of one s b h tensor."""
    return S * B * H * width


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_sixteen_bit_rank_with_a_sharded_optimizer_by_hand(dtype: str) -> None:
    """bf16 and fp16: 2 B weights, 4 B fp32 grads, masters 4 B and moments 8 B over
    dp; receive buffers 2 x chunks x s b h / t with sequence parallelism, the
    gathered input 2 s b h, the reduce-scattered fp32 shard 4 P / dp. Kills: any
    factor or divisor of those changed, sixteen_bit read as float32's, sequence
    parallelism's / t or its gathered input dropped."""
    spec = replace(DENSE, tp=2, sequence_parallel=True)
    n, dp, chunks = 1000, 4, 2
    got = _rank(3, n, 77.0, spec, chunks, Layout(pp=4, tp=2, dp=dp),
                Features(dtype=dtype, shard_optimizer=True))
    v = _values(2)
    assert got == RankMemory(3, n, 2.0 * n, 4.0 * n, 4.0 * n / dp, 8.0 * n / dp, 77.0,
                             2 * chunks * v / 2 + 2 * v + 4 * n / dp)


def test_a_float64_rank_without_sharding_by_hand() -> None:
    """float64: 8 B weights and grads, no masters, moments 2 x 8 B (not 2 x 4); no
    sequence parallelism: receive buffers 2 x chunks x s b h, nothing gathered, no
    gradient shard (the optimizer is not sharded, whatever dp). Kills: max(4, width)
    as min or 4 fixed, the moments' 2, the gathered input without sequence
    parallelism, the shard without a sharded optimizer."""
    spec = replace(DENSE, tp=2)
    n, chunks = 1000, 3
    got = _rank(0, n, 5.0, spec, chunks, Layout(pp=1, tp=2, dp=2), Features(dtype="float64"))
    v = _values(8)
    assert got == RankMemory(0, n, 8.0 * n, 8.0 * n, 0.0, 16.0 * n, 5.0, 2 * chunks * v)


def test_float32_with_a_sharded_optimizer_at_dp_one_holds_no_gradient_shard() -> None:
    """float32 at dp = 1: masters 0, moments 8 B, no reduce-scattered shard (dp 1 has
    no reduction); sequence parallelism at tp = 1 gathers nothing and divides the
    receive buffers by 1. Kills: `layout.dp > 1` as >= 1, `spec.tp > 1` as >= 1, the
    divisor t read at tp 1 as something else."""
    spec = replace(DENSE, sequence_parallel=True)
    n = 999
    got = _rank(1, n, 0.0, spec, 1, Layout(pp=2), Features(dtype="float32",
                                                          shard_optimizer=True))
    v = _values(4)
    assert got == RankMemory(1, n, 4.0 * n, 4.0 * n, 0.0, 8.0 * n, 0.0, 2 * v)


@pytest.mark.parametrize("ep,dp", [(2, 4), (4, 2), (1, 2)])
def test_expert_states_shard_over_dp_over_ep_and_the_all_to_all_buffers(ep: int,
                                                                        dp: int) -> None:
    """A mixture of experts with ep expert-parallel ranks: the sharded optimizer
    counts a rank's E expert parameters min(ep, dp) times (split over dp: over dp/ep
    each), and two passes' all-to-all send and receive buffers of s b k h each are
    held when ep > 1 (none at ep 1). Kills: min(ep, dp) as max or ep alone, the
    `- 1`, the a2a's 2 x 2 or top_k, `ep > 1` as >= 1."""
    spec = replace(MOE, ep=ep)
    n, experts = 1200, 400
    got = _rank(0, n, 0.0, spec, 1, Layout(pp=1, dp=dp), Features(shard_optimizer=True),
                experts)
    states = n + experts * (min(ep, dp) - 1)
    v = _values(2)
    a2a = 4 * v * MOE.top_k if ep > 1 else 0
    assert got == RankMemory(0, n, 2.0 * n, 4.0 * n, 4.0 * states / dp, 8.0 * states / dp,
                             0.0, 2 * v + 4 * states / dp + a2a)


def test_expert_states_without_a_sharded_optimizer_are_the_parameters() -> None:
    """Unsharded, the experts are among the rank's parameters already: masters and
    moments are 4 P and 8 P. Kills: the expert term added without sharding."""
    got = _rank(0, 1200, 0.0, MOE, 1, Layout(pp=1, dp=2), Features(), 400)
    assert (got.masters, got.optimizer) == (4.0 * 1200, 8.0 * 1200)


def _layer_by_hand(spec: ModelSpec, t: int) -> float:
    """One TP shard of a dense layer: Q and O (h x h each) split by t, K and V (h x
    kv d each) with max(kv / t, 1) heads a rank, SwiGLU's three h x f split by t, the
    two norms (h each) whole."""
    h, d = spec.hidden, spec.hidden // spec.heads
    return 2 * h * h / t + 2 * h * max(spec.kv_heads // t, 1) * d + 3 * h * spec.ffn / t + 2 * h


@pytest.mark.parametrize("t", [1, 2, 4])
def test_rank_parameters_by_hand_on_a_v_placement(t: int) -> None:
    """A V placement (stages 0 and 3 on rank 0, 1 and 2 on rank 1), 1 + 2 + 3 + 1
    layers, 101 words padded to a multiple of t: rank 0 holds the embedding (stage
    0), the output layer and final norm (stage 3); kv heads 2, so at t = 4 each rank
    holds one whole kv head. Kills: the vocab rows' ceiling, the embedding or output
    layer on the wrong stage, the final norm, any term of a layer's shard, the
    rounding of the per-rank sum."""
    spec = replace(DENSE, tp=t)
    rows = -(-101 // t)
    layer = _layer_by_hand(spec, t)
    got = rank_parameters(spec, 4, (0, 1, 1, 0), (1, 2, 3, 1))
    assert got == [round(2 * layer + 2 * rows * H + H), round(5 * layer)]


def test_rank_parameters_of_a_mixture_of_experts_and_its_experts_only() -> None:
    """An MoE layer's shard: the router (h x E) whole on every TP rank, the experts'
    3 h f_e E split by t and by ep. `experts_only`: of those, the experts alone, no
    embedding or output layer. Kills: the router split by t, the experts not split
    by ep, experts_only counting the rest."""
    spec = replace(MOE, tp=2, ep=2)
    t, ep = 2, 2
    experts = 3 * H * 32 * 4 / t / ep
    router = H * 4
    attn = 2 * H * H / t + 2 * H * 1 * (H // 8)
    layer = attn + router + experts + 2 * H
    rows = -(-101 // t)
    assert rank_parameters(spec, 2, (0, 1), (2, 2)) == [round(2 * layer + rows * H),
                                                        round(2 * layer + rows * H + H)]
    assert rank_parameters(spec, 2, (0, 1), (2, 2), experts_only=True) == \
        [round(2 * experts)] * 2


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (1024 ** 2 * 3, "3.00 MiB"), (1024 ** 3 * 12.3, "12.30 GiB"),
    (1024 ** 4 * 2, "2.00 TiB"), (1024 ** 5 * 3, "3072.00 TiB"),
])
def test_format_bytes(n: float, text: str) -> None:
    """Binary units, two decimals past bytes, TiB the largest. Kills: the 1024
    threshold or base changed, the cap at TiB lifted or lowered, the unit names."""
    assert format_bytes(n) == text


def _refused(call, message: str) -> None:
    """`call` raises ValueError with exactly `message`."""
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        call()


def test_refusals_name_the_bad_value_in_full() -> None:
    """Each refusal's whole line (what was asked, what is accepted). Kills: any
    message text altered or a value left out of it."""
    _refused(lambda: estimate(DENSE, HW, Layout(pp=2, dp=2, ep=2, seq_len=S)),
             "ep=2: expert parallelism needs a mixture-of-experts model; custom has no "
             "experts")
    _refused(lambda: estimate(replace(MOE, experts=6, top_k=2), HW,
                              Layout(pp=2, dp=4, ep=4, seq_len=S)),
             "ep=4 must divide the model's 6 experts")
    _refused(lambda: estimate(replace(DENSE, layers=3), HW,
                              Layout(pp=2, microbatches=2, seq_len=S, schedule="zb-v")),
             "the model's 3 layers cannot fill 4 stages of zb-v at pp=2")
    from stp.schedule.registry import generate
    _refused(lambda: estimate(DENSE, HW, Layout(pp=2, microbatches=4, seq_len=S),
                              schedule=generate("1f1b", 2, 2)),
             "schedule 1f1b: 2 ranks x 2 microbatches, but the layout is pp=2 m=4")
    _refused(lambda: estimate(DENSE, HW, Layout(pp=4, microbatches=4, seq_len=S),
                              schedule=generate("1f1b", 2, 4)),
             "schedule 1f1b: 2 ranks x 4 microbatches, but the layout is pp=4 m=4")


def test_a_spec_ep_that_does_not_divide_dp_is_priced_at_one_and_noted() -> None:
    """MoESpec(ep=2) at dp = 3: priced at ep = 1 (no all-to-all buffers, experts whole
    on the rank) with the note naming the spec, its ep and dp. At dp = 4 the spec's
    ep stays, without a note; Layout.ep overrides the spec's. Kills: the note's
    text, the fallback ep, `dp % ep == 0` inverted, Layout.ep ignored."""
    layout = Layout(pp=2, dp=3, microbatches=2, seq_len=S, schedule="1f1b")
    est = estimate(replace(MOE, name="tiny-moe"), HW, layout)
    assert est.notes == ("tiny-moe's ep=2 does not divide dp=3: priced at ep=1 (give dp a "
                         "multiple of 2, or ep)",)
    assert est.layout.ep == 1
    at_one = estimate(MOE, HW, replace(layout, dp=4, ep=1))
    assert [r.parameters for r in est.ranks] == [r.parameters for r in at_one.ranks]
    kept = estimate(MOE, HW, replace(layout, dp=4))
    assert kept.notes == () and kept.layout.ep == 2
    assert estimate(MOE, HW, replace(layout, dp=4, ep=4)).layout.ep == 4
    assert kept.ranks[0].parameters < at_one.ranks[0].parameters


def test_a_dense_model_at_layout_ep_one_is_priced() -> None:
    """ep=1 on a dense model is no expert parallelism: priced as ep=None. Kills: the
    (None, 1) accepted set narrowed to None."""
    layout = Layout(pp=2, dp=2, microbatches=2, seq_len=S, schedule="1f1b")
    assert estimate(DENSE, HW, replace(layout, ep=1)) == estimate(DENSE, HW, layout)


def test_the_layout_of_a_run_is_read_off_the_run() -> None:
    """memory_of_run rebuilds the layout from the simulated run: pp, tp, dp, m, the
    microbatch size, the sequence, the schedule's name, the partition. Kills: any
    field read from the wrong place or left at its default."""
    spec = replace(DENSE, tp=2, layers=6)
    layout = Layout(pp=2, tp=2, dp=2, microbatches=4, microbatch_size=B, seq_len=S,
                    schedule="zb-v", partition=(1, 2, 2, 1))
    est, res = estimate_run(spec, HW, layout)
    assert est.layout == layout
    again = memory_of_run(replace(spec, micro_batch=B, sequence=S), res, 1.0, dp=2)
    assert again.layout == layout
    assert again.step_time == res.makespan



def test_full_recomputation_under_a_deferred_w_is_noted_for_korthikantis_counting() -> None:
    """Korthikanti's formulas do not count what a deferred W keeps after a recomputed
    B: noted for a schedule with W passes (zb-v), not for one without (1f1b), not
    under recompute none or selective, not for stp's units (they count it). Kills:
    the note's text, any of its three conditions dropped or inverted."""
    layout = Layout(pp=2, microbatches=4, seq_len=S, schedule="zb-v")
    note = ("zb-v defers W: full recomputation's inputs kept for a deferred W are not "
            "counted (stp.costmodel.decoder.spec)",)
    assert estimate(DENSE, HW, layout, Features(recompute="full")).notes == note
    assert estimate(DENSE, HW, replace(layout, schedule="1f1b"),
                    Features(recompute="full")).notes == ()
    assert estimate(DENSE, HW, layout, Features(recompute="selective")).notes == ()
    assert estimate(DENSE, HW, layout, Features(recompute="full", runtime="stp")).notes == ()


@pytest.mark.parametrize("spec,features", [
    (DENSE, Features()),
    (DENSE, Features(dtype="float32", shard_optimizer=True, runtime="stp")),
    (replace(DENSE, tp=2), Features(sequence_parallel=True, recompute="full")),
    (MOE, Features(shard_optimizer=True)),
])
def test_states_bound_is_the_estimate_less_its_gradient_copies(spec, features) -> None:
    """Without offload the program-order activation peak is the simulator's, so
    states_bound is each rank's estimated total less only the DP gradient copies
    (the planner prunes by it). A MoE at dp 4 / ep 2: its experts' states split
    over dp/ep. With offload there is no bound. Kills: the bound built from other
    parameters (the experts' forgotten, experts_only dropped), the unit, the layout
    or the features passed on wrong, the offload check inverted."""
    from stp.costmodel.decoder.memory import states_bound

    layout = Layout(pp=2, tp=spec.tp, dp=4, microbatches=4, microbatch_size=B, seq_len=S,
                    schedule="zb-v")
    est = estimate(spec, HW, layout, features)
    bound = states_bound(spec, HW, layout, features)
    assert bound == pytest.approx([r.total - r.copies for r in est.ranks], rel=1e-12)
    assert states_bound(spec, HW, layout, replace(features, offload="all")) is None



TP1 = ModelSpec(layers=4, hidden=H, heads=8, kv_heads=2, ffn=96, vocab=101, sequence=S,
                micro_batch=B, dropout=False)


def test_at_one_tp_rank_a_schedules_backwards_pick_the_census_it_keeps() -> None:
    """stp's units at t = 1 keep more when W runs inside B (autograd's weight
    gradients, float32 norm values) than when W is deferred (stp.costmodel.kept).
    pp 2, m 4, two layers a stage, by hand from the census: 1F1B's rank 0 holds its
    two warm-up forwards of stage 0 (the embedding's bytes and two layers), native
    census; ZB-H1's rank 0 the same two, deferred census; ZB-H1's rank 1 one
    forward of the last stage and one deferred W's kept bytes, each part capped at
    what its B kept (W's output gradients never outweigh what B freed without full
    recomputation). Kills: the two censuses swapped or made one, the cap dropped,
    a stage's M_B not scaled to its census."""
    from stp.costmodel.decoder.kept import stp_kept

    native, deferred = stp_kept(TP1, 2, True), stp_kept(TP1, 2, False)
    layout = Layout(pp=2, microbatches=4, microbatch_size=B, seq_len=S, schedule="1f1b")

    def peaks(schedule: str) -> list[float]:
        est = estimate(TP1, HW, replace(layout, schedule=schedule), Features(runtime="stp"))
        return [r.activations_peak for r in est.ranks]

    one_f_one_b, zb_h1 = peaks("1f1b"), peaks("zb-h1")
    assert one_f_one_b[0] == pytest.approx(2 * (native.first_b + 2 * native.layer_b), rel=1e-12)
    assert zb_h1[0] == pytest.approx(2 * (deferred.first_b + 2 * deferred.layer_b), rel=1e-12)
    d = deferred
    assert d.layer_w > d.layer_b  # the cap matters here
    kept_by_w = min(d.last_w, d.last_b) + 2 * min(d.layer_w, d.layer_b)
    assert zb_h1[1] == pytest.approx(d.last_b + 2 * d.layer_b + kept_by_w, rel=1e-12)


def test_states_bound_of_a_given_schedule_and_an_uneven_partition() -> None:
    """The bound prices the schedule handed in (1f1b at pp 2: two stages) and the
    layout's partition (1 + 3 layers), as the estimate does. Kills: the given
    schedule replaced by the layout's generated zb-v (four stages), the even split
    used instead of the partition."""
    from stp.costmodel.decoder.memory import states_bound
    from stp.schedule.registry import generate

    layout = Layout(pp=2, dp=2, microbatches=4, microbatch_size=B, seq_len=S,
                    schedule="zb-v", partition=(1, 3))
    given = generate("1f1b", 2, 4)
    est = estimate(DENSE, HW, layout, schedule=given)
    bound = states_bound(DENSE, HW, layout, Features(), schedule=given)
    assert bound == pytest.approx([r.total - r.copies for r in est.ranks], rel=1e-12)
