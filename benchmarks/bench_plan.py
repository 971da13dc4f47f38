"""`stp plan` against published configurations, and how long planning takes.

    PYTHONPATH=src python3 benchmarks/bench_plan.py [--skip-405b-plan]

Prints, for each published setting, the planner's price of the published
configuration (`stp.plan.planner.priced_at`: the memory levers turned on
as the budget requires) and of its rivals, then what the planner itself
picks. The figures go in `benchmarks/results/plan.md`.

1. Llama 3 405B on 16,384 H100s ("The Llama 3 Herd of Models", arXiv
   2407.21783, section 3.3.2 and Table 4: TP8, PP16, DP128, sequence 8192,
   16M tokens a step = 2048 sequences, 41% BF16 MFU at this scale, 38-43%
   over its rows): the MFU the `h100-80g` preset predicts at that mesh with
   interleaved 1F1B at v chunks per rank (v = 4 with one layer fewer on the
   first and last stage is the assumed Llama 3 setting; plan.md says why),
   at the preset's efficiency 0.5 (stp's own 405B TP8 layer measured 0.49
   of the H100's peak, benchmarks/results/gpu-h100.md) and at 0.47, the MFU
   Megatron-LM's README reports for GPT-3 175B on H100 (a lower bound on
   what its matmuls achieve); neither is the measurement checked.
2. torchtitan's Llama 3.1 405B on 512 H100s ("TorchTitan", arXiv 2410.06511,
   Table 5: interleaved 1F1B 28% faster than 1F1B at FSDP8 x TP8 x PP8):
   stp shards the optimizer, not the parameters, so dp8 with the sharded
   optimizer; the global batch is assumed 128 sequences of 8192 (16
   microbatches per replica).
3. The STP paper's 12.1B setting (arXiv 2510.27257: qwen2-12.1b, TP8, PP2,
   sequence 6144, A800): STP against 1F1B-I and ZB-V.
4. Mixtures of experts on 64 H100s (Mixtral 8x7B, "Mixtral of Experts", arXiv
   2401.04088; Qwen2-57B-A14B, "Qwen2 Technical Report", arXiv 2407.10671):
   the ep the planner picks, against EP 8 inside a node (`--moe-only`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from stp.costmodel import HARDWARE, MODELS
from stp.plan import PlanRequest, plan
from stp.plan.planner import PlanResult, priced_at
from stp.plan.report import row_json, why
from stp.plan.space import Mesh, chunk_options, ep_options, schedules_for


def _line(name: str, p, request: PlanRequest) -> str:
    if p is None:
        return f"  {name:28s} does not fit"
    row = row_json(p, PlanResult([], request))
    f = p.config.features
    levers = [k for k, on in (("sp", f.sequence_parallel), ("zero1", f.shard_optimizer),
                              (f"recompute={f.recompute}", f.recompute != "none"),
                              (f"offload={f.offload}", f.offload != "none")) if on]
    crit = p.result.critical_rank
    return (f"  {name:28s} step {row['step_time_s']:7.3f} s  MFU {row['mfu']:6.1%}  "
            f"peak {p.peak_bytes / 2**30:5.1f} GiB  [compute {crit.compute / 1e3:.2f} "
            f"idle {crit.idle / 1e3:.2f} TP {crit.exposed_tp / 1e3:.2f} "
            f"DP {p.dp_sync_s:.2f} exposed of {p.dp_sync_total_s:.2f} s]  "
            f"levers {','.join(levers) or '-'}")


LLAMA3_PARTITION = (1, *([2] * 62), 1)
"""126 layers on 16 x 4 stages, one layer fewer on the first and last stage
(Llama 3's balancing, arXiv 2407.21783, section 3.3.2)."""


def llama3() -> None:
    print("Llama 3 405B, 16384 x h100-80g, 2048 x 8192 tokens, pp16 tp8 dp128, b1 m16")
    rows = [("1f1b-interleaved", 2, None), ("1f1b-interleaved", 4, None),
            ("1f1b-interleaved", 4, LLAMA3_PARTITION), ("1f1b-interleaved", 7, None),
            ("zb-interleaved", 4, LLAMA3_PARTITION), ("1f1b", None, None),
            ("zb-v", None, None), ("stp", None, None)]
    for eff in (0.5, 0.47):
        req = PlanRequest(model=MODELS["llama3-405b"],
                          hardware=replace(HARDWARE["h100-80g"], efficiency=eff),
                          gpus=16384, global_batch=2048, seq_len=8192)
        for name, v, part in rows:
            p = priced_at(req, Mesh(16, 8, 128), 1, name, v, part)
            label = f"{name}{f' v{v}' if v else ''}{' 1,2..2,1' if part else ''} eff={eff}"
            print(_line(label, p, req))


def llama3_plan() -> None:
    req = PlanRequest(model=MODELS["llama3-405b"], hardware=HARDWARE["h100-80g"], gpus=16384,
                      global_batch=2048, seq_len=8192, top=3)
    cpu, wall = time.process_time(), time.perf_counter()
    result = plan(req)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"stp plan llama3-405b on 16384 x h100-80g: {cpu:.1f} s CPU ({wall:.1f} s wall), "
          f"{result.considered} configurations, {result.pruned_memory} ruled out by memory, "
          f"{result.pruned_time} by time, {result.simulated} simulations")
    for i, p in enumerate(result.plans, 1):
        c = p.config
        v = f" v{c.chunks}" if c.chunks else ""
        print(_line(f"#{i} pp{c.mesh.pp} tp{c.mesh.tp} dp{c.mesh.dp} {c.schedule}{v} "
                    f"b{c.microbatch_size}", p, req))
        if p.partition is not None:
            print(f"     partition {','.join(map(str, p.partition))}")
    print("  why:", why(result.plans[0], result.plans[1]))


def torchtitan() -> None:
    print("torchtitan Llama 3.1 405B, 512 x h100-80g, 128 x 8192 tokens, pp8 tp8 dp8, b1 m16")
    req = PlanRequest(model=MODELS["llama3-405b"], hardware=HARDWARE["h100-80g"], gpus=512,
                      global_batch=128, seq_len=8192)
    got = {"1f1b": priced_at(req, Mesh(8, 8, 8), 1, "1f1b")}
    for v in chunk_options("1f1b-interleaved", 8, req.model.layers):
        got[f"1f1b-interleaved v{v}"] = priced_at(req, Mesh(8, 8, 8), 1, "1f1b-interleaved", v)
    for name, p in got.items():
        print(_line(name, p, req))
    a = got["1f1b"]
    for name, b in got.items():
        if a is not None and b is not None and b is not a:
            print(f"  {name} over 1F1B: {a.step_s / b.step_s - 1:+.1%} throughput "
                  "(published: +28%)")


def stp_paper() -> None:
    print("STP paper: qwen2-12.1b, 16 x a800-80g, 32 x 6144 tokens, pp2 tp8 dp1, b1 m32")
    req = PlanRequest(model=MODELS["qwen2-12.1b"], hardware=HARDWARE["a800-80g"], gpus=16,
                      global_batch=32, seq_len=6144)
    got = {n: priced_at(req, Mesh(2, 8, 1), 1, n) for n in ("stp", "zb-v")}
    for v in chunk_options("1f1b-interleaved", 2, req.model.layers):
        got[f"1f1b-interleaved v{v}"] = priced_at(req, Mesh(2, 8, 1), 1, "1f1b-interleaved", v)
    for name, p in got.items():
        print(_line(name, p, req))
    s = got["stp"]
    for rival in got:
        r = got[rival]
        if rival == "stp":
            continue
        if s is not None and r is not None:
            print(f"  stp over {rival}: {r.step_s / s.step_s - 1:+.1%} throughput "
                  "(published: up to +12%)")


MOE_REQUESTS = (("mixtral-8x7b", 512, 4096), ("qwen2-57b-a14b", 512, 4096))
"""Mixtures of experts on 64 H100s (8 nodes of 8): 512 sequences of 4096 a step
(2M tokens; neither model card publishes its training batch, so this one is
assumed)."""


def _moe_plan(req: PlanRequest) -> PlanResult:
    cpu, wall = time.process_time(), time.perf_counter()
    result = plan(req)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    held = f" held to --ep {','.join(map(str, req.ep))}" if req.ep else ""
    print(f"  plan{held}: {cpu:.1f} s CPU ({wall:.1f} s wall), {result.considered} "
          f"configurations, {result.pruned_memory} ruled out by memory, {result.pruned_time} "
          f"by time, {result.simulated} simulations")
    return result


def _moe_name(p) -> str:
    c = p.config
    v = f" v{c.chunks}" if c.chunks else ""
    return (f"pp{c.mesh.pp} tp{c.mesh.tp} dp{c.mesh.dp} ep{c.mesh.ep} {c.schedule}{v} "
            f"b{c.microbatch_size}")


def _ep8_in_a_node(req: PlanRequest):
    """The fastest tp 1, ep 8 configuration at microbatch size 1 (each EP group one
    node of 8), every pp and schedule priced as the planner prices it."""
    best = None
    for pp in (1, 2, 4, 8):
        mesh = Mesh(pp, 1, req.gpus // pp, 8)
        for name, v in schedules_for(req, mesh):
            p = priced_at(req, mesh, 1, name, v)
            if p is not None and (best is None or p.step_s < best.step_s):
                best = p
    return best


def moe() -> None:
    """Mixtures of experts (stp.plan.experts): the planner's top 5 with ep
    searched, the best held to ep 1 and to ep 8 (EP 8 is the common setting for
    Mixtral and Qwen MoE trainings), and the best mesh at every ep it admits:
    step, exposed all-to-all, DP sync, peak."""
    for name, batch, seq in MOE_REQUESTS:
        model = replace(MODELS[name], ep=1)
        print(f"{name}, 64 x h100-80g, {batch} x {seq} tokens")
        req = PlanRequest(model=model, hardware=HARDWARE["h100-80g"], gpus=64,
                          global_batch=batch, seq_len=seq, top=5)
        result = _moe_plan(req)
        for i, p in enumerate(result.plans, 1):
            print(_line(f"#{i} {_moe_name(p)}", p, req))
        print("  why:", why(result.plans[0], result.plans[1]))
        for held in ((1,), (8,)):
            best = _moe_plan(replace(req, ep=held, top=1)).plans[0]
            print(_line(f"best {_moe_name(best)}", best, req))
        node = _ep8_in_a_node(req)
        print(_line(f"EP 8 in a node: {_moe_name(node)}", node, req) if node else
              "  EP 8 in a node (tp 1): nothing fits")
        widest = max(result.plans, key=lambda p: p.config.mesh.dp)  # the most ep options
        for top in [result.plans[0], *([widest] if widest is not result.plans[0] else [])]:
            c = top.config
            print(f"  pp{c.mesh.pp} tp{c.mesh.tp} dp{c.mesh.dp} {c.schedule} b{c.microbatch_size}"
                  " at each ep (exposed all-to-all on the critical rank):")
            for ep in ep_options(req, c.mesh.dp):
                p = priced_at(req, replace(c.mesh, ep=ep), c.microbatch_size, c.schedule,
                              c.chunks)
                a2a = "" if p is None else f" a2a {p.result.critical_rank.exposed_a2a / 1e3:.3f} s"
                print(_line(f"ep{ep}", p, req) + a2a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-405b-plan", action="store_true",
                    help="leave out the full plan of 405B on 16384 GPUs (about 50 s of CPU)")
    ap.add_argument("--moe-only", action="store_true",
                    help="only the mixtures of experts (about 5 minutes of CPU)")
    args = ap.parse_args()
    if args.moe_only:
        moe()
        return
    llama3()
    torchtitan()
    stp_paper()
    if not args.skip_405b_plan:
        llama3_plan()
    moe()


if __name__ == "__main__":
    main()
