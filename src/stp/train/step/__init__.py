"""One training step: the `Trainer` (`trainer`), the collectives after the
backward (`grad_sync`, `in_flight`, `param_gather`), clipping (`clip`), mixed
precision and the optimizer update (`precision`, `lr`), the sharded optimizer
(`zero`, `shard_layout`), auxiliary losses (`aux_losses`), non-finite steps
(`finite`) and the held-out loss (`evaluate`).

This package imports nothing itself.
"""
