"""A measured trace names each unit's layer and part from the unit's name in its stage:
an expert-parallel MoE layer runs four units (attention, route, experts, combine) and
a dense layer two, so a fixed two units per layer would mislabel every unit after
the first MoE layer. Simulated spans keep the simulator's two units per layer."""

from __future__ import annotations

from stp.models import StagePlacement
from stp.models.moe.dispatch import ExpertGroup
from stp.models.moe.stage import build_moe_stage
from stp.runtime.trace import Recorder
from stp.schedule.ir import Kind, Pass
from stp.shapes import MoEConfig
from stp.sim import Span
from stp.viz import trace_events


def _unit_args(spans: list[Span]) -> list[tuple[int, str]]:
    events = [e for e in trace_events(spans, time_scale=1e6)
              if e["ph"] == "X" and e["cat"] == "compute"]
    return [(e["args"]["layer"], e["args"]["part"]) for e in events if "unit" in e["args"]]


def test_expert_parallel_moe_units_are_labelled_by_their_layer_and_part():
    # layer 0 dense (moe_every 2 routes layers 1, 3, ..), layer 1 MoE over 2 EP ranks
    cfg = MoEConfig(vocab_size=40, hidden=16, num_layers=2, num_heads=2, num_kv_heads=1,
                    ffn_hidden=32, max_seq_len=8, num_experts=4, top_k=2, expert_ffn=8,
                    moe_every=2)
    stage = build_moe_stage(cfg, StagePlacement(0, 1), expert_group=ExpertGroup(None, 2, 0))
    rec = Recorder(0, [0])
    for u in range(len(stage.units)):  # embed, 2 dense, 4 MoE units, loss
        rec.unit(Pass(0, Kind.F, 0), "F", stage, u, float(u), u + 0.5, 0, False)
    assert _unit_args(rec.spans()) == [
        (0, "attn"), (0, "mlp"), (1, "attn"), (1, "moe.route"), (1, "moe.experts"),
        (1, "moe.combine")]


def test_simulated_spans_keep_two_units_per_layer():
    spans = [Span(0, "compute", u, u + 0.5, "0F0", "F", 0, 0, 0, unit=u) for u in range(4)]
    assert _unit_args(spans) == [(0, "attention"), (0, "mlp"), (1, "attention"), (1, "mlp")]
