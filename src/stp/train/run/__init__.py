"""One run: its settings (`config.TrainJob`), their checks before any worker
starts (`job`, `precheck`, `memory_check`), where the model comes from
(`model_source`, `pretrained`, `plan_file`), how a Trainer's parts are made
once (`setup`, `parts`, `resolve`, `schedules`), the loop of one run (`loop`),
and what it reports about itself (`startup`, `mfu`, `memory_measure`).

This package imports nothing itself, so `stp train --help` stays free of torch.
"""
