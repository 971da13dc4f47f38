"""Peak host memory of a rank loading its shard of a Hugging Face checkpoint.

Writes a random float32 Llama checkpoint (default about 245 MB: vocabulary
8192, hidden 1024, 4 layers, in safetensors files of at most 64 MB with an
index), then, for every rank of a pp x tp mesh (default 2 x 2), loads that
rank's shard in a fresh process, as `Trainer(..., init_from=DIR)` does on
each rank: `build_stage(..., weights=HFCheckpoint.read)` reads only the
rank's slices (its stage's layers, its TP rows or columns). No process group
is needed: loading communicates nothing. For comparison it loads the whole
model in one process (`stp.models.hf.load`).

Per rank it prints the bytes of its shard and its peak resident-memory
increase during the load (the process's high-water mark VmHWM after the load
minus its resident size before it; torch already imported). Linux only.

    python3 benchmarks/bench_hf_load.py [--pp 2] [--tp 2] [--hidden 1024] [--layers 4] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MB = 2**20


def write_checkpoint(path: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Llama checkpoint (float32) at `path`; returns its tensor bytes."""
    import torch

    from stp.models import ModelConfig
    from stp.models.decoder.init import parameter_specs
    from stp.models.hf import config_to_hf, save_state

    config = ModelConfig(vocab_size=vocab, hidden=hidden, num_layers=layers,
                         num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256),
                         max_seq_len=2048)
    gen = torch.Generator().manual_seed(0)
    state = {s.name: torch.randn(s.shape, generator=gen) * 0.02 for s in parameter_specs(config)}
    save_state(path, state, config, max_shard_bytes=64 * MB)
    assert config_to_hf(config, "float32")["model_type"] == "llama"
    return sum(t.numel() * t.element_size() for t in state.values())


def _status_bytes(field: str) -> int:
    """A /proc/self/status memory figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS where the kernel allows (Linux >= 4.0); VmHWM
    is per address space, so even without the reset it starts fresh at exec (unlike
    ru_maxrss, which keeps the parent's peak from before the fork)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def measure(path: str, stage: int, num_stages: int, tp: int, tp_rank: int) -> dict[str, int]:
    """Load one rank's shard in this process: (shard bytes, peak RSS increase)."""
    import torch

    from stp.models import StagePlacement, build_stage
    from stp.models.hf import HFCheckpoint

    # torch's own lazy allocations before the baseline: its first parallel kernel
    # starts the intra-op threads (their stacks and malloc arenas, ~6 MB here), which
    # a training process pays once whatever it loads.
    warm = torch.ones(1 << 20)
    assert bool(torch.isfinite(warm).all())
    del warm
    _reset_peak()
    before = _status_bytes("VmRSS")
    ckpt = HFCheckpoint.open(path)
    if num_stages == 0:  # the whole model, for comparison
        from stp.models.hf import load

        model = load(path)
        shard = sum(p.numel() * p.element_size() for p in model.parameters())
    else:
        where = StagePlacement(stage, num_stages, tp_size=tp, tp_rank=tp_rank)
        st = build_stage(ckpt.config, where, allreduce=lambda t: t, weights=ckpt.read)
        shard = sum(p.numel() * p.element_size() for p in st.parameters())
    return {"shard_bytes": shard, "peak_increase_bytes": _status_bytes("VmHWM") - before}


def measure_in_child(path: str, stage: int, num_stages: int, tp: int,
                     tp_rank: int) -> dict[str, int]:
    """`measure` in a fresh interpreter (its own peak RSS)."""
    cmd = [sys.executable, __file__, "--measure", path, str(stage), str(num_stages), str(tp),
           str(tp_rank)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--json", action="store_true")
    p.add_argument("--measure", nargs=5, metavar=("DIR", "STAGE", "STAGES", "TP", "RANK"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        path, *nums = args.measure
        print(json.dumps(measure(path, *map(int, nums))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        total = write_checkpoint(Path(tmp), args.hidden, args.layers, args.vocab)
        rows: list[dict[str, Any]] = []
        for stage in range(args.pp):
            for r in range(args.tp):
                rows.append({"stage": stage, "tp_rank": r,
                             **measure_in_child(tmp, stage, args.pp, args.tp, r)})
        whole = measure_in_child(tmp, 0, 0, 1, 0)
    if args.json:
        print(json.dumps({"model_bytes": total, "ranks": rows, "whole_model": whole}))
        return
    print(f"model: {total / MB:.0f} MB of float32 weights, pp={args.pp} x tp={args.tp}")
    print(f"{'stage':>5s} {'tp':>3s} {'shard MB':>9s} {'peak +MB':>9s}")
    for row in rows:
        print(f"{row['stage']:5d} {row['tp_rank']:3d} {row['shard_bytes'] / MB:9.1f} "
              f"{row['peak_increase_bytes'] / MB:9.1f}")
    print(f"whole model in one process: peak +{whole['peak_increase_bytes'] / MB:.1f} MB")


if __name__ == "__main__":
    main()
