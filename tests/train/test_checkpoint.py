"""Sharded checkpoints: exact resume, resume on another mesh, keep, bad paths.

float64, clipping and a cosine schedule active. A run of 6 steps saves after
step 4; a Trainer resumed from that checkpoint on the same mesh (pp2 x tp2)
repeats steps 4 and 5 bit for bit (loss, grad_norm, lr); on pp4 (another
schedule) and on one process (taking its batches from `data=`, which resume
advances past the 4 batches used) within 1e-9.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from _dist import run_dist
from _train_common import CONFIG, TOL, M, batch, optimizer, options, train, worst

from stp.cli.main import main
from stp.runtime.mesh import Mesh, ParallelDims
from stp.schedule import registry
from stp.train.checkpoint import sharded as checkpoint
from stp.train.step.trainer import Trainer


def _four_ranks(rank: int, world: int, root: str) -> dict:
    mesh = Mesh.from_world(ParallelDims(2, 2, 1), timeout=60)
    trainer = Trainer(CONFIG, optimizer(), registry.make("stp", 2, M), mesh=mesh, **options())
    straight = train(trainer, range(4))
    path = trainer.save(root)
    straight += train(trainer, range(4, 6))
    again = Trainer.resume(root, CONFIG, optimizer(), registry.make("stp", 2, M), mesh=mesh,
                           **options())
    start = again.steps_done
    same = train(again, range(4, 6))
    pp4 = Trainer.resume(root, CONFIG, optimizer(), registry.make("1f1b", 4, M),
                         mesh=Mesh.from_world(ParallelDims(4, 1, 1), timeout=60), **options())
    return {"straight": straight, "path": path, "start": start, "same": same,
            "pp4": train(pp4, range(4, 6))}


def _one_rank(rank: int, world: int, root: str, other: str) -> dict:
    data = (batch(step) for step in itertools.count())  # resume skips the 4 batches used
    trainer = Trainer.resume(root, CONFIG, optimizer(), "1f1b", pp=1, microbatches=M,
                             data=data, **options())
    out: dict = {"start": trainer.steps_done, "one": []}
    for _ in range(2):
        loss = trainer.step()
        out["one"].append((loss, trainer.last_update.grad_norm, trainer.last_update.lr))
    for step in range(6, 9):  # keep=2: only the two newest stay
        trainer.save(other, keep=2)
        train(trainer, range(step, step + 1))
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    other = tmp_path_factory.mktemp("keep")
    four = run_dist(_four_ranks, 4, str(root), timeout=240)
    one = run_dist(_one_rank, 1, str(root), str(other), timeout=120)[0]
    return {"four": four, "one": one, "root": root, "other": other}


@pytest.mark.slow
def test_resume_on_the_same_mesh_is_bit_for_bit(resumed: dict) -> None:
    for r in resumed["four"]:
        assert r["start"] == 4
        assert r["same"] == r["straight"][4:]  # exact float equality
    assert Path(resumed["four"][0]["path"]).name == "step-00000004"


@pytest.mark.slow
def test_resume_on_pp4_and_on_one_process(resumed: dict) -> None:
    straight = resumed["four"][0]["straight"][4:]
    assert worst(resumed["four"][0]["pp4"], straight) <= TOL
    assert resumed["one"]["start"] == 4
    assert worst(resumed["one"]["one"], straight) <= TOL


@pytest.mark.slow
def test_checkpoint_stores_global_shapes_and_keeps_the_newest(resumed: dict) -> None:
    found = checkpoint.latest(resumed["root"])
    assert found.name == "step-00000004"
    md = dcp.FileSystemReader(found).read_metadata().state_dict_metadata
    # saved on tp=2: the vocab-sharded embedding is stored whole, in two chunks
    assert tuple(md["model/embed.weight"].size) == (CONFIG.vocab_size, CONFIG.hidden)
    assert len(md["model/embed.weight"].chunks) == 2
    assert len(md["model/layers.0.attn_norm.weight"].chunks) == 1  # TP-replicated: once
    assert {"optim/embed.weight/exp_avg", "optim/embed.weight/step", "scheduler",
            "trainer"} <= set(md)
    info = checkpoint.read_info(found)
    assert (info["step"], info["pp"], info["tp"], info["schedule"]) == (4, 2, 2, "stp")
    kept = [p.name for p in checkpoint.complete_checkpoints(resumed["other"])]
    assert kept == ["step-00000007", "step-00000008"]


def test_unwritable_out_is_refused_before_training(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = blocker / "run"
    start = time.monotonic()
    code = main(["train", "--pp", "1", "--layers", "2", "--out", str(bad)])
    err = capsys.readouterr().err
    assert code == 2
    assert str(bad) in err and "not a writable directory" in err, err
    assert time.monotonic() - start < 10


def test_resume_without_a_complete_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / ".step-00000004.partial").mkdir()  # what a killed save leaves
    code = main(["train", "--pp", "1", "--layers", "2", "--resume", str(tmp_path),
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "holds no complete checkpoint" in err and str(tmp_path) in err, err
