"""What stp's CUDA paths do on one GPU, measured: unit times against the cost model,
the offload copier's overlap, single-GPU training with each memory lever.

    PYTHONPATH=src python3 benchmarks/bench_gpu.py --out benchmarks/results/gpu-h100.json

Three parts, each recorded under its key in the JSON (`--only` picks some):

  units    F, B and W of one decoder layer as stp's units run it (bf16, one TP
           rank's shard: `build_stage(..., StagePlacement(1, 3, tp_size=t))` with an identity
           all-reduce, so the FLOPs are exactly one rank's), timed with CUDA events
           (median of `--repeat`), against the cost model's prediction for the same
           layer on `h100-80g` (`stp.costmodel.decoder.costs.derive_decoder`). The
           achieved fraction of the 989 TFLOP/s bf16 peak is what `stp plan` takes as
           the hardware's `efficiency` (0.5 assumed); this measures it for stp's own
           layer code, independently of any published MFU.
  copier   the activation-offload copier (`stp.runtime.offload_copy.CudaCopier`): a
           matmul chain alone, a device-to-host copy alone, and both at once on the
           copier's side stream; `overlap_of_shorter` is the time saved by running
           both at once over the shorter one (1: the pair takes as long as its
           longer member), and the copy alone gives the host bandwidth that
           `h100-80g` assumes to be 50 GB/s.
  compile  `stp train` eager against `--compile` (the pieces between the linears
           compiled, stp.models.compile): step time, compile seconds, first losses.
  train    `stp train` on this GPU (NCCL, one rank, pp 1) with --recompute none,
           selective, full and --offload all: step time, tokens/s and the measured
           bytes per category beside `stp memory`'s estimate for the same flags.
  peer     the single-device peer (issue 35): a plain PyTorch loop written without
           stp (stp.bench.plain_loop: its own attention via SDPA, SwiGLU, RMSNorm,
           rotary; fp32 parameters under bf16 autocast, fused AdamW, gradient
           accumulation, clipping), eager and torch.compile, beside the step `stp
           train --pp 1 --schedule 1f1b` runs, eager and --compile, on the same
           shape, batches and optimizer settings, rounds alternating
           (stp.bench.single_device.time_sides): ms/step, tokens/s, MFU, peak bytes,
           and `eager_ms_per_step_ratio` / `compiled_ms_per_step_ratio` (stp / plain).
           On a GPU the issue's two shapes (8 layers, hidden 2048, 16/8 heads, seq
           2048, 4 x 2 sequences; 16 layers, hidden 4096, 32/8 heads, seq 4096,
           4 x 1), bf16; on the CPU a small one in float32.

`--counts` (any machine, the CPU, small shape): per step, for stp's step and the
plain loop, eager and compiled, aten ops, autograd nodes, compiled-graph calls
and host synchronisations by kind and by place in the code
(stp.bench.step_counts.count_sides), and the ratios stp / plain; `--md FILE`
rewrites the tables between FILE's `<!-- counts -->` markers
(benchmarks/results/single_device.md says the command).

A multi-rank run (TP or PP across GPUs, NCCL all-reduces braided) needs as many
GPUs as ranks: NCCL refuses two ranks on one device. With one GPU the braided
collective paths stay measured on the CPU (`stp bench overlap`).

On a machine with no GPU the script runs each part at toy sizes on the CPU so
that it can be checked before a GPU is lent (`--cpu-smoke`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from stp.bench.single_device import SIDES, SingleSpec, time_sides
from stp.bench.step_counts import count_sides, counts_with_ratios
from stp.costmodel.decoder.costs import derive_decoder
from stp.costmodel.decoder.spec import layer_flops
from stp.costmodel.presets import HARDWARE, MODELS
from stp.models import ModelConfig, StagePlacement, build_stage

PEAK_BF16 = 989e12  # H100 SXM5 dense bf16 (datasheet), as `h100-80g` says


def _timer(device: torch.device) -> Callable[[Callable[[], None]], float]:
    """Milliseconds of fn: CUDA events on a GPU, the wall clock on the CPU."""
    def cuda_ms(fn: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def cpu_ms(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cuda_ms if device.type == "cuda" else cpu_ms


def _layer_config(name: str, smoke: bool) -> tuple[ModelConfig, int, int]:
    """(config of a 3-layer model whose middle stage is one layer, tp, sequence)."""
    spec = MODELS[name]
    if smoke:
        spec = replace(spec, hidden=256, heads=8, kv_heads=8, ffn=512, sequence=128)
    cfg = ModelConfig(vocab_size=256, hidden=spec.hidden, num_layers=3, num_heads=spec.heads,
                      num_kv_heads=spec.kv_heads, ffn_hidden=spec.ffn,
                      max_seq_len=spec.sequence)
    return cfg, spec.tp, spec.sequence


def _time_layer(stage, x: torch.Tensor, timed, repeat: int) -> dict[str, list[float]]:
    """F, B and W of microbatch 0 through `stage`, `repeat` times after two warm-ups
    (kernel selection, allocator growth)."""
    g = torch.randn_like(x)
    times: dict[str, list[float]] = {"f": [], "b": [], "w": []}
    for r in range(repeat + 2):
        f = timed(lambda: stage.forward(0, x))
        b = timed(lambda: stage.backward_input(0, g))
        w = timed(lambda: stage.backward_weight(0))
        if r >= 2:
            for key, v in zip("fbw", (f, b, w), strict=True):
                times[key].append(v)
    return times


def bench_units(device: torch.device, names: list[str], repeat: int, smoke: bool) -> list[dict]:
    """F, B, W of one layer shard per preset, measured and predicted (module doc)."""
    timed = _timer(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for name in names:
        cfg, tp, seq = _layer_config(name, smoke)
        stage = build_stage(cfg, StagePlacement(1, 3, tp_size=tp, dtype=dtype, device=device),
                            allreduce=lambda a: a)
        x = torch.randn(1, seq, cfg.hidden, dtype=dtype, device=device)
        times = _time_layer(stage, x, timed, repeat)
        spec = replace(MODELS[name], layers=1, micro_batch=1, sequence=seq)
        if smoke:
            spec = replace(spec, hidden=cfg.hidden, heads=cfg.num_heads,
                           kv_heads=cfg.num_kv_heads, ffn=cfg.ffn_hidden)
        flops = layer_flops(spec)
        predicted = derive_decoder(spec, HARDWARE["h100-80g"], 1).costs
        row: dict = {"preset": name, "tp": tp, "sequence": seq, "hidden": cfg.hidden,
                     "dtype": str(dtype).removeprefix("torch.")}
        for key, fl, pred in zip("fbw", flops, (predicted.f, predicted.b, predicted.w),
                                     strict=True):
            ms = statistics.median(times[key])
            row[key] = {"ms": ms, "min_ms": min(times[key]), "predicted_ms": pred,
                        "tflops": fl / (ms / 1e3) / 1e12,
                        "efficiency": fl / (ms / 1e3) / PEAK_BF16}
        total_fl = sum(flops)
        total_ms = sum(row[k]["ms"] for k in "fbw")
        row["efficiency_fbw"] = total_fl / (total_ms / 1e3) / PEAK_BF16
        rows.append(row)
        del stage, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_copier(device: torch.device, mib: int, repeat: int) -> dict:
    """Offload copies beside compute on the copier's side stream (module doc)."""
    from stp.runtime.offload_copy import CudaCopier

    if device.type != "cuda":
        return {"skipped": "needs a CUDA device"}
    timed = _timer(device)
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    src = torch.randn(mib << 18, dtype=torch.float32, device=device)  # mib MiB
    copier = CudaCopier(device)

    def compute() -> None:
        for _ in range(8):
            torch.mm(a, a)

    def copy() -> None:
        host, event = copier.to_host(src.untyped_storage())
        copier.wait(event)

    def both() -> None:
        host, event = copier.to_host(src.untyped_storage())
        compute()
        copier.wait(event)

    runs: dict[str, list[float]] = {"compute": [], "copy": [], "both": []}
    for r in range(repeat + 2):
        for key, fn in (("compute", compute), ("copy", copy), ("both", both)):
            ms = timed(fn)
            if r >= 2:
                runs[key].append(ms)
    med = {k: statistics.median(v) for k, v in runs.items()}
    # the time saved by running both at once, over the shorter of the two: 1 when
    # the pair takes only as long as its longer member (the shorter fully hidden)
    hidden = (med["compute"] + med["copy"] - med["both"]) / min(med["compute"], med["copy"])
    return {"copy_mib": mib, "compute_ms": med["compute"], "copy_ms": med["copy"],
            "both_ms": med["both"], "overlap_of_shorter": max(0.0, min(1.0, hidden)),
            "host_gb_per_s": (mib << 20) / (med["copy"] / 1e3) / 1e9,
            "assumed_host_gb_per_s": HARDWARE["h100-80g"].host_bandwidth / 1e9}


def _stp(args: list[str]) -> dict:
    """The summary line of `stp ... --json` (the last JSON object printed)."""
    cmd = [sys.executable, "-m", "stp.cli.main", *args, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:], "rc": out.returncode}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    docs = [json.loads(ln) for ln in lines]
    steps = [d["step_s"] for d in docs if "step_s" in d][1:]  # first step: warm-up
    summary = docs[-1]
    if steps:
        summary["median_step_s"] = statistics.median(steps)
    return summary


def bench_train(smoke: bool) -> list[dict]:
    """stp train on this GPU with each memory lever, beside stp memory (module doc)."""
    if smoke:
        model = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64"]
        steps = "3"
    else:
        model = ["--layers", "8", "--hidden", "2048", "--heads", "16", "--kv-heads", "8",
                 "--seq-len", "2048"]
        steps = "6"
    common = ["--pp", "1", "--schedule", "1f1b", "--microbatches", "4",
              "--microbatch-size", "2", "--dtype", "bfloat16", *model]
    rows = []
    for name, extra in (("none", []), ("selective", ["--recompute", "selective"]),
                        ("full", ["--recompute", "full"]), ("offload", ["--offload", "all"])):
        with tempfile.TemporaryDirectory() as out:
            run = _stp(["train", *common, *extra, "--steps", steps, "--out", out])
        est = _stp(["memory", *common, *extra])
        rows.append({"lever": name, "flags": " ".join(common + extra),
                     "median_step_s": run.get("median_step_s"),
                     "measured": run.get("memory", run), "estimated": est.get("memory", est)})
    return rows


def bench_compile(smoke: bool) -> list[dict]:
    """stp train eager against --compile on this device (module doc): the same run,
    step time after the first, compile seconds, and the first losses side by side."""
    model = (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "64"] if smoke
             else ["--layers", "8", "--hidden", "2048", "--heads", "16", "--kv-heads", "8",
                   "--seq-len", "2048"])
    common = ["--pp", "1", "--schedule", "1f1b", "--microbatches", "4", "--microbatch-size",
              "2", "--dtype", "bfloat16" if not smoke else "float32", "--steps", "6", *model]
    rows = []
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "stp.cli.main", "train", *common, *extra,
                   "--out", out, "--json"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            rows.append({"run": name, "error": (done.stderr or done.stdout)[-2000:]})
            continue
        docs = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
        steps = [d for d in docs if "step_s" in d]
        rows.append({"run": name, "flags": " ".join(common + extra),
                     "median_step_s": statistics.median(d["step_s"] for d in steps[1:]),
                     "compile_s": sum(d.get("compile_s", 0.0) for d in steps),
                     "losses": [d["loss"] for d in steps]})
    return rows


PEER_SHAPES = {  # the two GPU shapes, and a small one for the CPU
    "372m": SingleSpec(layers=8, hidden=2048, heads=16, kv_heads=8, seq_len=2048,
                       microbatches=4, microbatch_size=2, device="cuda"),
    "2.8b": SingleSpec(layers=16, hidden=4096, heads=32, kv_heads=8, seq_len=4096,
                       microbatches=4, microbatch_size=1, device="cuda"),
    "cpu-small": SingleSpec(layers=2, hidden=64, heads=4, kv_heads=4, seq_len=64,
                            microbatches=4, microbatch_size=2, device="cpu"),
}


def bench_peer(device: torch.device, rounds: int) -> list[dict]:
    """The single-device peer (module doc) on each shape of this device."""
    names = ["372m", "2.8b"] if device.type == "cuda" else ["cpu-small"]
    rows = []
    for name in names:
        try:
            row = time_sides(PEER_SHAPES[name], rounds=rounds, steps=3, warmup=2)
        except torch.OutOfMemoryError as e:  # 2.8b: a pair needs about 100 GB
            row = {"error": f"out of memory: {str(e).splitlines()[0]}"}
        rows.append({"shape": name, **row})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_peer(row: dict) -> str:
    """One Markdown table of a shape's four sides and the stp / plain ratios."""
    if "error" in row:
        return f"shape {row['shape']}: {row['error']}"
    lines = [f"shape {row['shape']} ({row['spec']['dtype']}): "
             + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ratio")),
             "| side | ms/step | tokens/s | MFU | resident | peak | warm-up s |",
             "|---|---|---|---|---|---|---|"]
    for side, r in row["sides"].items():
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 1e9:.2f} GB"
        lines.append(f"| {side} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:.0f} | {mfu} | "
                     f"{r['resident_bytes'] / 1e9:.3f} GB | {peak} | {r['warmup_s']:.1f} |")
    return "\n".join(lines)


COUNT_KEYS = ("aten ops", "autograd nodes", "compiled graph calls", "host syncs")


def format_counts(doc: dict) -> str:
    """The counts per step as Markdown: one table, then each side's host reads by place."""
    lines = ["| side | " + " | ".join(COUNT_KEYS) + " | AdamW step-counter reads (no sync) |",
             "|---" * (len(COUNT_KEYS) + 2) + "|"]
    for side, r in doc["sides"].items():
        cells = " | ".join(f"{r.get(k, 0):.0f}" for k in COUNT_KEYS)
        steps = r.get("AdamW step-counter reads (host tensors, no sync)", 0)
        lines.append(f"| {side} | {cells} | {steps:.0f} |")
    lines.append("")
    lines += [f"- `{k}`: {v:.3f}" for k, v in doc.items() if k.endswith("_ratio")]
    for mode in ("eager", "compiled"):
        more = doc.get(f"{mode} aten_ops stp runs more")
        if more:
            lines.append(f"- {mode}, the aten ops stp runs most more often (stp / plain per "
                         "step): " + ", ".join(f"`{k}` {a:g} / {b:g}"
                                               for k, (a, b) in more.items()))
    for side, r in doc["sides"].items():
        kinds = ", ".join(f"{k.removeprefix('sync: ')} {v:g}" for k, v in r.items()
                          if k.startswith("sync: "))
        places = "; ".join(f"`{k}` {v:g}" for k, v in r["host reads by place"].items())
        lines.append(f"- {side}: host syncs by kind: {kinds or 'none'}; host reads by place: "
                     f"{places or 'none'}")
    return "\n".join(lines)


def counts_main(out: str | None, md: str | None) -> int:
    """--counts: the per-step counts at the small CPU shape, eager and compiled."""
    spec = PEER_SHAPES["cpu-small"]
    counts = count_sides(spec, sides=SIDES)
    doc = {"torch": torch.__version__, "spec": spec.__dict__ | {"dtype": spec.dtype},
           **counts_with_ratios(counts)}
    text = format_counts(doc)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)
    if md:
        with open(md) as fh:
            page = fh.read()
        head, mark, rest = page.partition("<!-- counts -->")
        _, end, tail = rest.partition("<!-- /counts -->")
        if not mark or not end:
            raise SystemExit(f"{md}: no <!-- counts --> ... <!-- /counts --> markers")
        with open(md, "w") as fh:
            fh.write(f"{head}{mark}\n{text}\n{end}{tail}")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--only", default="units,copier,train,compile,peer", help="parts to run")
    p.add_argument("--presets", default="llama3-405b,qwen2-12.1b,qwen2-72b,zb-6.2b")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--cpu-smoke", action="store_true", help="toy sizes on the CPU")
    p.add_argument("--counts", action="store_true",
                   help="only the per-step counts of stp and the plain loop on the CPU")
    p.add_argument("--md", default=None, help="with --counts: rewrite this file's tables")
    p.add_argument("--rounds", type=int, default=3, help="peer: alternating rounds")
    args = p.parse_args(argv)
    if args.counts:
        return counts_main(args.out, args.md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = torch.device("cuda") if cuda else torch.device("cpu")
    doc: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda
                 else "cpu", "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda
                 else None}
    parts = args.only.split(",")
    names = [n for n in args.presets.split(",") if n in MODELS]

    def save() -> None:
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(doc, fh, indent=1)

    if "units" in parts:
        doc["units"] = bench_units(device, names, args.repeat, not cuda)
        save()
        print("| preset | tp | seq | F ms (pred) | B ms (pred) | W ms (pred) | eff F/B/W "
              "| eff all |")
        print("|---|---|---|---|---|---|---|---|")
        for r in doc["units"]:
            cells = " | ".join(f"{r[k]['ms']:.2f} ({r[k]['predicted_ms']:.2f})" for k in "fbw")
            eff = "/".join(f"{r[k]['efficiency']:.2f}" for k in "fbw")
            print(f"| {r['preset']} | {r['tp']} | {r['sequence']} | {cells} | {eff} | "
                  f"{r['efficiency_fbw']:.2f} |")
    if "copier" in parts:
        doc["copier"] = bench_copier(device, 1024, args.repeat)
        save()
        print("copier:", json.dumps(doc["copier"]))
    if "train" in parts:
        doc["train"] = bench_train(not cuda)
        save()
        for r in doc["train"]:
            m, e = r["measured"], r["estimated"]
            act = (m.get("activations_peak"), e.get("activations_peak"))
            print(f"train {r['lever']}: step {r['median_step_s']} s, activations measured "
                  f"{act[0]} estimated {act[1]}, total {m.get('total')} vs {e.get('total')}")
    if "compile" in parts:
        doc["compile"] = bench_compile(not cuda)
        save()
        for r in doc["compile"]:
            print(f"compile {r['run']}: " + (str(r["error"]) if "error" in r else
                  f"step {r['median_step_s'] * 1e3:.1f} ms, compile {r['compile_s']:.1f} s, "
                  f"losses {[round(x, 5) for x in r['losses'][:3]]}"))
    if "peer" in parts:
        doc["peer"] = bench_peer(device, args.rounds)
        save()
        for row in doc["peer"]:
            print(format_peer(row))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
