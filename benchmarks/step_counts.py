"""What one `Trainer.step` costs in calls, counted (not timed): aten ops, host reads of
device tensors, autograd nodes run, per step, in one process on the CPU.

    PYTHONPATH=src python3 benchmarks/step_counts.py [--dtype float32|bfloat16]
        [--optimizer adamw|sgd] [--compile] [--top 15]

A small decoder (hidden 64, 4 layers, 4 heads, sequence 128), pp=1, 1F1B over 4
microbatches of 4 sequences, three warm-up steps, then one step under
torch.profiler (CPU activities) and a TorchFunctionMode that records every
`item`, `tolist`, `cpu`, `numpy` and Python conversion of a tensor (a host
sync on an accelerator; reads of the caller's batch, host memory, left out:
tests/train/test_host_syncs.py counts the same way). `aten::_local_scalar_dense`
inside the optimizer's step is reported apart: torch's fused CPU AdamW reads
each parameter's step count, a host tensor, in C++ (on a GPU the count lives on
the device and is not read). The counts do not depend on the machine's speed.
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from stp.bench.host_reads import HostReads


def _inside(event: Any, prefix: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)

    from stp.models import ModelConfig
    from stp.train.step.lr import adamw
    from stp.train.step.trainer import Trainer

    torch.manual_seed(0)
    cfg = ModelConfig(hidden=64, num_layers=4, num_heads=4, num_kv_heads=4, max_seq_len=128)
    factory = adamw(1e-3) if args.optimizer == "adamw" else (
        lambda ps: torch.optim.SGD(ps, lr=1e-3))
    trainer = Trainer(cfg, factory, "1f1b", microbatches=4, dtype=getattr(torch, args.dtype),
                      **({"compile": True} if args.compile else {}))
    ids = torch.randint(0, cfg.vocab_size, (16, 129), generator=torch.Generator().manual_seed(0))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    for _ in range(3):
        trainer.step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof, HostReads(batch) as reads:
        trainer.step(batch)
    events = list(prof.events())
    aten = collections.Counter(e.name for e in events if e.name.startswith("aten::"))
    nodes = sum(1 for e in events if e.name.startswith("autograd::engine::evaluate_function"))
    in_opt = sum(1 for e in events if e.name == "aten::_local_scalar_dense"
                 and _inside(e, "Optimizer.step"))
    print(f"{args.dtype} {args.optimizer}{' compiled' if args.compile else ''}: "
          f"aten ops {sum(aten.values())}, autograd nodes {nodes}, host reads "
          f"{len(reads.reads)} {reads.reads}, aten::_local_scalar_dense "
          f"{aten['aten::_local_scalar_dense']} ({in_opt} inside the optimizer's step)")
    for name, n in aten.most_common(args.top):
        print(f"  {n:6d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
