"""What stp's own decoder units keep for their backward: a census, in bytes.

`stp.costmodel.decoder.spec`'s activation formulas are Korthikanti et al.'s
counting ("Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198) for a Megatron-style layer. stp's runtime
(`stp.models.decoder.units`, torch's scaled_dot_product_attention) keeps
other tensors: no s x s scores (a float32 log-sum-exp per head instead), but
the rotated q and k, the attention output, each unit's row-parallel output
before its all-reduce (full width, sequence parallel or not), all four SwiGLU
intermediates, and each RMSNorm's float32 normalised values. Counted with
`stp.runtime.offload`'s census (every storage a forward keeps, once) on
torch 2.13, per token of one microbatch on one TP rank (`w` the compute
dtype's bytes, `k d` the key/value width one rank holds, `sp` = t with
sequence parallelism, else 1):

    F to B, per layer   R + w ((2h + 4f) / t + 2kd) + 4 (a / t + 2 / sp)
                        R = 2wh + 8h at t = 1 (one graph per unit), 2wh + 16h
                        when every W runs inside its B (autograd's weight
                        gradients: the norms keep float32 values for them);
                        R = w (2h + 4h/sp) + 8h/sp at t > 1 (two graphs, and the two
                        partial outputs at full width)
    B to W, per layer   w (2h/sp + 2h/t + 2h + 3f/t + 2kd) + 2 (4 + w) h / sp
    embedding           y h at t = 1 (B keeps the token ids, the stage's input
                        itself), y = 4 (float32) or 6 (bfloat16) with W inside B,
                        12 or 6 with W deferred (the first layer's input is the
                        embedding's output); 9 (local ids, ownership mask) at
                        t > 1;  W: (8 + w h) / t
    loss head           w (3h + V) + 8 + x h at t = 1, x = 4 (float32) or 12
                        (bfloat16) with W inside B, 12 or 8 with W deferred;
                        w (2h + V/t) + 4h/sp + 4 + 4/sp at t > 1;
                        W: w (h + V/t) + (4 + w) h / sp

The end terms at t = 1 are tables, not a rule: what they count differs with
the dtype and with who computes the weight gradients, and no simpler
account was found. These reproduce the census to the byte, F to B, in
float32 and bfloat16 at t = 1 and 2, and float32 with sequence parallelism
at t = 2 (h 256, 4 heads, 2 kv heads, f 704, V 320, s 128, b 4; and h 64 at
t = 1, tests/runtime/test_kept_census.py); the B-to-W terms within 1%.
A mixture of experts (`stp.costmodel.moe`) reads `f` as the width a token
computes and adds, per routed copy, `3 w h + 8` F to B (the gathered input,
the expert output before and after its routing weight, the token index)
and `2 w h` B to W, and the router's `routing_bytes`; the census of
`stp.models.moe.units` (h 64 and 128, E 4 and 8, k 1 and 2, with and
without a shared expert, float32 and bfloat16, t = 1) finds 4 w h + 28
bytes more per token and MoE layer, w h more with a shared expert, and at
t = 1 in float32 with W inside B not the dense unit's 8 h of norm values
(`MoESpec.kept_extra`): fitted to the census, not derived; with them every
case measured agrees within 11 bytes a token (0.3%). At t = 2 the dense
count already holds the 4 w h + 28 (one measured run, the `moe-stp-tp2`
row of `benchmarks/results/memory.md`; no census at t > 1 yet).
`selective` is taken to keep the same as none (the fused attention keeps no
scores to drop). Full recomputation (stp.models.recompute), per token:

    F to B, per layer   w h / sp at t = 1 (the fused layer chunk keeps its
                        input once per stage: exact for one layer, an upper
                        bound for more), 2 w h / sp at t > 1 (each of a
                        layer's two units keeps its input)
    embedding           9 (local ids, mask: the first layer's graph is rebuilt) at
                        t > 1, 0 at t = 1 (the ids are the stage's input)
    loss head           w h / sp + 4 (its input rows, the float32 log-sum-exp)
    B to W              as without recomputation, per layer and at the ends:
                        B rebuilds a unit's graph and walks it as the forward
                        without recomputation would have, so a deferred W gets
                        the same (x, dy) of every matrix and norm gain

so with W deferred the B-to-W bytes exceed the F-to-B bytes many times over:
B allocates (stp.sim.stages.StageCost.mem_w). The census checks the t = 1
terms (float32 and bfloat16: tests/runtime/test_kept_census.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from stp.costmodel.decoder.spec import ModelSpec

__all__ = ["Kept", "stp_kept"]


@dataclass(frozen=True)
class Kept:
    """Bytes one microbatch keeps on one TP rank: per layer and at the two ends,
    from F until B (`*_b`) and from B until W (`*_w`)."""

    layer_b: float
    layer_w: float
    first_b: float
    first_w: float
    last_b: float
    last_w: float


def _measured(table: dict[tuple[int, bool], int], w: int, native: bool) -> float:
    """A measured bytes-per-h entry; a dtype not measured (float64) scales float32's
    by its width (these bytes are activations of the run's dtype)."""
    return table.get((w, native), table[4, native] * w / 4)


def stp_kept(spec: ModelSpec, dtype_bytes: int, native_weights: bool = False, *,
             two_graphs: bool = False) -> Kept:
    """The census formulas of the module doc for `spec` (its tp, sequence,
    micro_batch, sequence_parallel and recompute) in a run of `dtype_bytes`.
    `native_weights`: the schedule runs every W inside its B (1f1b, gpipe, ...), so
    at t = 1 autograd computes the weight gradients and the norms keep float32
    values for them; a schedule that defers W taps the linears instead.
    `two_graphs`: every unit keeps two graphs even at t = 1, as the t > 1 terms
    count (the multimodal stage's decoder units, stp.costmodel.mllm.memory: the
    t > 1 terms reproduce its census at t = 1 to the byte)."""
    # f: the width a token computes (a mixture of experts: its top-k and shared experts)
    h, f, a, t, v = spec.hidden, spec.mlp_width, spec.heads, spec.tp, spec.vocab
    w = dtype_bytes
    sp = t if spec.sequence_parallel else 1
    kd = max(spec.kv_heads // t, 1) * spec.head_dim
    tokens = spec.sequence * spec.micro_batch
    # t = 1: one graph per unit (stp.models.decoder.units), the norms' float32 values;
    # t > 1: two graphs per unit, and the two partial outputs at full width
    one_graph = t == 1 and not two_graphs
    replicated = (w * 2 * h + 4 * (4 if native_weights else 2) * h if one_graph
                  else w * (2 * h + 4 * h / sp) + 4 * 2 * h / sp)
    layer_b = replicated + w * ((2 * h + 4 * f) / t + 2 * kd) + 4 * (a / t + 2 / sp)
    layer_w = w * (2 * h / sp + 2 * h / t + 2 * h + 3 * f / t + 2 * kd) + 2 * (4 + w) * h / sp
    # a mixture of experts (stp.models.moe.units): per routed copy the gathered input and
    # the expert's output before its routing weight (h each) and the token index (8), and
    # the router's logits and softmax; W reads each copy's input and output gradient
    copies = spec.routed_copies
    layer_b += copies * (3 * w * h + 8) + spec.routing_bytes + spec.kept_extra(w, t,
                                                                              native_weights)
    layer_w += copies * 2 * w * h
    if one_graph:  # bytes per h in the embedding (its ids are the input) and the loss head
        first_b = _measured({(4, True): 4, (4, False): 12, (2, True): 6, (2, False): 6},
                                w, native_weights) * h
        extra = _measured({(4, True): 4, (4, False): 12, (2, True): 12, (2, False): 8},
                          w, native_weights)
        last_b = w * (3 * h + v) + 8 + extra * h
    else:
        first_b = 9.0
        last_b = w * (2 * h + v / t) + 4 * h / sp + 4 + 4 / sp
    if spec.recompute == "full":  # B-to-W as without it (module doc)
        layer_b = w * h / sp * (1 if one_graph else 2)
        first_b, last_b = 0.0 if one_graph else 9.0, w * h / sp + 4
    first_w = (8 + w * h) / t
    last_w = w * (h + v / t) + (4 + w) * h / sp
    return Kept(*(x * tokens for x in (layer_b, layer_w, first_b, first_w, last_b, last_w)))
