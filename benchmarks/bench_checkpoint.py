"""Sharded checkpoints (stp.train.checkpoint.sharded) of a model of a few hundred MB.

Two gloo workers train a byte-level decoder (default h=768, 8 layers: about
60M parameters, 240 MB in float32) on pp=2 with AdamW, then print:

  save        seconds for `trainer.save` (every rank writes its own file in
              parallel; the slowest rank), and the bytes each rank wrote:
              its parameters and their two AdamW moments, about 3x its share
  load        seconds to load that checkpoint into a fresh Trainer on the same
              mesh (pp=2), and on another one (tp=2: every rank reads parts of
              every stage's files)
  overhead    mean wall time per step over `--steps` steps without saving and
              with `--save-every N`, and the difference: what the checkpoint
              costs a run, per step

The checkpoint lands in a temporary directory (or `--dir`), deleted at the end.
On a shared CPU the times are noisy: compare them at low load.

    python3 benchmarks/bench_checkpoint.py [--hidden H] [--layers L] [--steps N]
                                           [--save-every N] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _trainer(args: argparse.Namespace, mesh: Any) -> Any:
    from stp.models import ModelConfig
    from stp.train.step.lr import adamw
    from stp.train.step.trainer import Trainer

    config = ModelConfig(vocab_size=256, hidden=args.hidden, num_layers=args.layers,
                         num_heads=args.heads, num_kv_heads=args.heads, max_seq_len=64, seed=0)
    schedule = "1f1b" if mesh.dims.pp > 1 else "gpipe"
    return Trainer(config, adamw(1e-4), schedule, mesh=mesh, microbatches=2, timeout=600)


def _timed(fn: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _steps(trainer: Any, batches: Any, args: argparse.Namespace, root: Path,
           every: int) -> float:
    """Mean wall seconds per step, saving every `every` steps (0: never)."""
    def run() -> None:
        for step in range(args.steps):
            trainer.step(batches.batch(step))
            if every and (step + 1) % every == 0:
                trainer.save(str(root), keep=1)

    return _timed(run) / args.steps


def _worker(args: argparse.Namespace, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    from stp.runtime.launch import init_distributed
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.checkpoint import sharded as checkpoint
    from stp.train.data.corpus import ByteBatches, read_corpus

    init_distributed(timeout=600)
    rank, out = dist.get_rank(), Path(root)
    pp2 = Mesh.from_world(ParallelDims(2, 1, 1), timeout=600)
    tp2 = Mesh.from_world(ParallelDims(1, 2, 1), timeout=600)
    batches = ByteBatches.from_bytes(read_corpus(), 64, 2, seed=0)
    trainer = _trainer(args, pp2)
    trainer.step(batches.batch(0))  # creates the optimizer state
    res: dict[str, Any] = {"params": sum(p.numel() for p in trainer.parameters)}
    res["save_s"] = _timed(lambda: trainer.save(str(out / "one")))
    path = checkpoint.latest(out / "one")
    res["bytes"] = sum(f.stat().st_size for f in path.glob(f"__{rank}_*.distcp"))
    for name, mesh in (("load_s", pp2), ("load_tp2_s", tp2)):
        fresh = _trainer(args, mesh)
        res[name] = _timed(lambda fresh=fresh: checkpoint.load(
            fresh.parts, fresh.optimizer, fresh.scheduler, path))
        del fresh
    res["step_s"] = _steps(trainer, batches, args, out / "every", 0)
    res["step_saving_s"] = _steps(trainer, batches, args, out / "every", args.save_every)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per overhead run")
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--dir", help="where to write (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from stp.runtime.launch import launch_local

    root = Path(args.dir or tempfile.mkdtemp(prefix="stp-bench-ckpt-"))
    try:
        got = launch_local(_worker, (args, str(root)), 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if got.exitcode:
        sys.exit(f"workers failed (ranks {got.failed_ranks})")
    ranks = [got.returns[r] for r in range(2)]
    if args.json:
        print(json.dumps({"config": vars(args), "ranks": ranks}))
        return
    params = sum(r["params"] for r in ranks)
    step = max(r["step_s"] for r in ranks)
    saving = max(r["step_saving_s"] for r in ranks)
    print(f"decoder h={args.hidden} L={args.layers}: {params / 1e6:.1f}M parameters, "
          f"{4 * params / 2**20:.0f} MiB in float32; AdamW; pp=2, gloo on CPU")
    for r, res in enumerate(ranks):
        print(f"rank {r}: wrote {res['bytes'] / 2**20:7.1f} MiB")
    print(f"save {max(r['save_s'] for r in ranks):6.2f} s   load pp=2 "
          f"{max(r['load_s'] for r in ranks):6.2f} s   load tp=2 "
          f"{max(r['load_tp2_s'] for r in ranks):6.2f} s")
    print(f"step {step:.2f} s without saving, {saving:.2f} s with --save-every "
          f"{args.save_every}: {saving - step:+.2f} s per step ({saving / step - 1:+.1%})")


if __name__ == "__main__":
    main()
