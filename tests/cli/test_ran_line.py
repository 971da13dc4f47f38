"""`stp train`'s summary says what it ran in one line (`ran: ...`): the mesh, the
schedule and batch, the dtype, sequence parallelism, recomputation, the sharded
optimizer, the overlaps, offload and the model (a mixture of experts with its
experts, top-k and ep; a multimodal model with its vision encoder), each as it
took effect (a flag that has no effect at its mesh reads off); and an MoE's
figures (load-balancing loss, expert load) reach the terminal, not only --json."""

from __future__ import annotations

import json
from types import SimpleNamespace

from stp.cli.flags import from_args
from stp.cli.main import build_parser, main
from stp.cli.train_output import Progress as _Progress
from stp.cli.train_output import ran_line as _ran_line
from stp.train.run.config import TrainJob
from stp.train.run.job import model_config
from stp.train.run.loop import RunSummary


def _ran(*argv: str, parameters: int = 140_000) -> str:
    job = from_args(TrainJob, build_parser().parse_args(["train", *argv]))
    summary = RunSummary(job=job, microbatches=job.num_microbatches, backend="gloo",
                         device="cpu", parameters=parameters, losses=(1.0,),
                         step_times_s=(0.1,), tokens_per_step=1,
                         resident_activation_bytes=None, checkpoint=None)
    return _ran_line(summary, model_config(job))


def test_decoder_line_states_every_setting_as_given() -> None:
    line = _ran("--pp", "2", "--tp", "2", "--dp", "2", "-m", "6", "--microbatch-size", "3",
                "--seq-len", "32", "--schedule", "1f1b", "--dtype", "bfloat16",
                "--sequence-parallel", "--recompute", "selective", "--shard-optimizer",
                "--overlap-grad-sync", "off", "--overlap-param-gather", "on",
                "--offload", "stp", "--layers", "6", "--hidden", "128")
    assert line == ("ran: pp2 tp2 dp2 schedule 1f1b m6 mb3 seq 32 | bfloat16 | sp on | "
                    "recompute selective | shard-optimizer on | overlap grad-sync off, "
                    "param-gather on | offload stp | model decoder 6x128 (140k params)")


def test_settings_without_effect_read_off() -> None:
    # sequence parallelism at tp 1 and the sharded optimizer (and its gather) at dp 1
    line = _ran("--sequence-parallel", "--shard-optimizer", "--overlap-param-gather", "on")
    assert "| sp off |" in line and "| shard-optimizer off |" in line
    assert "param-gather off" in line
    assert line.startswith("ran: pp2 tp1 dp1 schedule stp m8 mb4 seq 64 | float32 |")
    assert line.endswith("| model decoder 4x64 (140k params)")


def test_moe_line_names_experts_top_k_and_ep() -> None:
    line = _ran("--arch", "moe", "--experts", "8", "--top-k", "3", "--dp", "2", "--ep", "2",
                parameters=2_500_000)
    assert line.endswith("| model moe 4x64 (2.5M params), moe 8 experts top-3 ep2"), line


def test_mllm_line_names_the_vision_encoder() -> None:
    line = _ran("--arch", "mllm", "--image-size", "64", "--patch", "8", "--merge", "2",
                "--vision-layers", "3", "--vision-hidden", "16", "--layers", "2")
    assert line.endswith("| model mllm vision 3x16 (64-px images, patch 8, merge 2) + "
                         "decoder 2x64 (140k params)"), line


def test_progress_line_shows_the_moe_figures(capsys) -> None:
    progress = _Progress(4, as_json=False)
    progress(SimpleNamespace(step=0, loss=5.0, tokens_per_s=1000.0, step_time_s=0.1,
                             grad_norm=1.0, lr=1e-3, eval_loss=None, skipped=False,
                             figures={"aux_loss": 2.0312, "expert_load": 1.25}))
    assert "| aux 2.031 | load 1.25" in capsys.readouterr().err


MOE = ["--arch", "moe", "--pp", "1", "--layers", "2", "--hidden", "32", "--heads", "4",
       "--seq-len", "16", "--microbatch-size", "1", "-m", "2", "--schedule", "1f1b",
       "--steps", "3", "--timeout", "120"]


def test_moe_run_prints_ran_line_and_figures(capfd, tmp_path) -> None:
    assert main(["train", *MOE, "--json", "--out", str(tmp_path / "o")]) == 0
    got = capfd.readouterr()
    steps = [r for r in map(json.loads, got.out.splitlines()) if "loss" in r]
    assert len(steps) == 3
    ran = [line for line in got.err.splitlines() if line.startswith("ran: ")]
    assert len(ran) == 1 and ran[0].endswith("moe 4 experts top-2 ep1"), got.err
    # the figures --json gives, on the human summary too
    first, last = steps[0]["aux_loss"], steps[-1]["aux_loss"]
    assert (f"moe: aux loss {first:.4g} -> {last:.4g}, expert load "
            f"{steps[-1]['expert_load']:.2f} in the last step") in got.err, got.err


def test_document_masking_is_said_when_on() -> None:
    assert "| offload none | document-mask | model decoder" in _ran("--document-mask")
    assert "document-mask" not in _ran()
