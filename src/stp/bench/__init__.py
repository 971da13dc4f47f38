"""Measurement of the runtime: the code behind `stp bench` and `benchmarks/`.

A layer of its own between `train` and `cli`, so the application layer
carries no profilers, page-fault counters or timing loops; nothing below
imports it.

- `overlap`: TP all-reduce hidden by a braided block (`stp bench overlap`).
- `fidelity`: measured step times of emulated stages, for the simulator to
  predict (`stp bench fidelity`).
- `collectives`: one all-reduce and one point-to-point send, timed.
- `peer`: stp's Trainer against torch.distributed.pipelining (`stp bench peer`);
  `peer_torch` is the PyTorch side, `peer_table` prints the figures and
  `probes` measures a process (CPU time, page faults, peak memory, cProfile).

Import from the modules: this package imports nothing itself, so
`stp bench --help` stays free of torch.
"""
