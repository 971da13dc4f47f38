"""stp: synergistic tensor and pipeline parallelism.

Layers, pointing one way: `stp.schedule` (IR, generators, validation), `stp.sim`
(discrete-event simulator) and `stp.viz` (pictures, traces) import no torch;
`stp.runtime`, `stp.models` and `stp.train.step.trainer` run schedules on torch.distributed.
"""

__version__ = "0.1.0"
