"""The application layer: training runs built on the runtime and the models.

- `config`: `TrainJob`, the settings of one `stp train` run (no torch; the CLI
  derives its flags from it).
- `job`: checks of a job before any worker starts, its model and schedule.
- `loop`: the training loop of one run on an initialised world.
- `trainer`: `Trainer`, one object that trains a model on a TP x PP x DP mesh.
- `parts`, `setup`: what a Trainer is made of (`TrainerOptions`, `Parts`) and
  `setup.build`, which makes its Parts once (stages, precision, executor, ...).
- `grad_sync`: a step's collectives after the backward (shared-gradient sum,
  loss sum, DP average, gradient norm), their errors mapped one way.
- `precision`: bf16 with fp32 master weights and main grads; the optimizer update.
- `clip`: the global gradient norm over pp x tp x dp, and clipping by it.
- `lr`: learning-rate schedules and AdamW parameter groups.
- `checkpoint`, `shards`: sharded checkpoints any mesh can resume from.
- `save_full`: the whole model as one safetensors file, written stage by stage
  (`--save-full`); `gather`: the whole model on rank 0 (tests, small models).
- `evaluate`: held-out loss with forward passes only.
- `data`: the byte-level corpus and deterministic batches.

Import from the modules (`from stp.train.trainer import Trainer`): this
package imports nothing itself, so `stp train --help` stays free of torch.
"""
