"""stp's per-unit runtime overhead against plain autograd, in one process.

One middle pipeline stage (4 of 8 layers: 8 units, no embedding or head), the
forward and full backward of one microbatch [4, 128, hidden], single thread,
CPU time per round, the variants interleaved round by round so that the drift
of a shared machine hits each alike:

  two graphs     each unit as two autograd graphs (norm, TP body) with W deferred
                 (the path every unit takes at tp > 1)
  one graph      one graph per unit (tp = 1), W deferred (Zero Bubble's split B)
  plain          one graph, plain autograd: B gets the weight gradients in the
                 same graph walk
  fused          the 4 layers as one unit (stp.models.decoder.chunk), W deferred
  fused plain    the 4 layers as one unit, plain autograd (what a full-backward
                 microbatch runs at tp = 1, the default)
  torch          the same layers as plain autograd code (stp.bench.peer_torch.DecoderPart),
                 forward and backward()

    python3 benchmarks/bench_unit_overhead.py [--hidden 64,256] [--rounds 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from stp.bench.peer_torch import DecoderPart
from stp.models import ModelConfig, ModelStage, StagePlacement, build_stage


def _stage(cfg: ModelConfig, one_graph: bool, plain: bool, fused: bool = False) -> ModelStage:
    st = build_stage(cfg, StagePlacement(1, 3), fuse_layers=fused)  # a middle stage
    for unit in st.units if not fused else ():
        unit.one_graph = one_graph  # type: ignore[attr-defined]
    st.weights_in_backward(range(1) if plain else ())
    return st


def _variants(hidden: int) -> dict[str, Callable[[], None]]:
    cfg = ModelConfig(hidden=hidden, num_layers=8, num_heads=4, num_kv_heads=4,
                      max_seq_len=128)
    x, g = torch.randn(4, 128, hidden), torch.randn(4, 128, hidden)
    stages = {"two graphs": _stage(cfg, False, False), "one graph": _stage(cfg, True, False),
              "plain": _stage(cfg, True, True), "fused": _stage(cfg, True, False, True),
              "fused plain": _stage(cfg, True, True, True)}
    part = DecoderPart(cfg, stages["plain"].layer_ids, first=False, last=False)

    def stp(st: ModelStage) -> Callable[[], None]:
        def step() -> None:
            st.forward(0, x)
            st.backward_full(0, g)
        return step

    def plain_torch() -> None:
        part(x.detach().requires_grad_(True)).backward(g)

    return {**{k: stp(v) for k, v in stages.items()}, "torch": plain_torch}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", default="64,256", help="comma-separated widths (default 64,256)")
    p.add_argument("--rounds", type=int, default=100, help="timed rounds (default 100)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| hidden | variant | CPU ms | / torch | + us per unit |\n|---|---|---|---|---|")
    for hidden in (int(h) for h in args.hidden.split(",")):
        fns = _variants(hidden)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(args.rounds + 3):
            for name, fn in fns.items():
                start = time.process_time()
                fn()
                if r >= 3:  # warm-up rounds untimed
                    times[name].append(time.process_time() - start)
        base = statistics.median(times["torch"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {hidden} | {name} | {med * 1e3:.2f} | {med / base:.3f} | "
                  f"{(med - base) / 8 * 1e6:+.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
