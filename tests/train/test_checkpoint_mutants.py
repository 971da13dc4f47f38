"""stp.train.checkpoint.sharded in one process: a world of one gloo rank in pytest's own
process, a save and a load of a small mixed-precision model against the tensors
torch's AdamW and LambdaLR held when it was saved.

Written to kill mutants mutmut left alive in stp/train/checkpoint/sharded.py
(docs/testing.md): its other tests save and resume trainers in spawned ranks,
which mutmut cannot map to mutants. Each test names the bug it guards against.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo  # noqa: F401  imported by the first optimizer step: 40 s a mutant here
import torch.distributed as dist
from torch import nn

from stp.train.checkpoint import checks, sharded
from stp.train.step.precision import Precision

SHAPES = {"embed.weight": (4, 3), "norm.weight": (3,)}


@pytest.fixture
def world_of_one():
    """A default process group of one gloo rank in this process, destroyed after; one
    that an earlier test of the session left (a one-process Trainer's) is used as it is."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1, "another test left a world of several ranks"
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Stage:
    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.params = params

    def named_parameters(self):
        yield from self.params.items()

    def shard_dim(self, name: str) -> None:
        return None


def _trainer(dtype: torch.dtype, seed: int):  # noqa: ANN202
    """(parts, optimizer, scheduler) of a one-stage model, as a Trainer holds them."""
    gen = torch.Generator().manual_seed(seed)
    params = {n: nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for n, s in SHAPES.items()}
    prec = Precision(list(params.items()))
    opt = torch.optim.AdamW([{"params": prec.params[:1], "weight_decay": 0.1},
                             {"params": prec.params[1:], "weight_decay": 0.0}],
                            lr=0.05, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    parts = SimpleNamespace(
        stages={0: _Stage(params)}, precision=prec,
        dims=SimpleNamespace(pp=1, tp=1, dp=1),
        mesh=SimpleNamespace(rank=0, coord=SimpleNamespace(tp=0)),
        schedule=SimpleNamespace(name="1f1b"), options=SimpleNamespace(dtype=dtype),
        model_config=None, named_parameters=lambda: list(params.items()))
    return parts, opt, sched


def _step(parts, opt, sched, k: int) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(100 + k)
    for g in parts.precision.grads():
        g.copy_(torch.randn(g.shape, generator=gen))
    opt.step()
    sched.step()
    parts.precision.copy_to_model()


def test_a_resumed_run_goes_on_bit_for_bit(world_of_one, tmp_path: Path) -> None:
    """Kills: a tensor left out of the save or the load (model, master, a moment, the
    step), the masters loaded from the bf16 model (`master/` key test inverted), the
    group hyperparameters (lr, weight decay) not restored or restored to the wrong
    group, the scheduler or the RNG not restored, the step returned wrong, masters
    not rounded into the model after the load. Reference: the run that did not stop."""
    parts, opt, sched = _trainer(torch.bfloat16, seed=1)
    for k in range(2):
        _step(parts, opt, sched, k)
    random.seed(5)
    torch.manual_seed(5)
    path = sharded.save(parts, opt, sched, 2, tmp_path)
    assert path == tmp_path / "step-00000002"
    rng_after_save = (torch.rand(3).tolist(), random.random())

    again, opt2, sched2 = _trainer(torch.bfloat16, seed=9)  # other weights: all must load
    opt2.param_groups[0]["lr"] = opt2.param_groups[1]["lr"] = 7.0
    assert sharded.load(again, opt2, sched2, path) == 2
    assert (torch.rand(3).tolist(), random.random()) == rng_after_save
    assert sched2.last_epoch == sched.last_epoch == 2
    for g, g2 in zip(opt.param_groups, opt2.param_groups, strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {
            k: v for k, v in g2.items() if k != "params"}
    for m, m2 in zip(parts.precision.params, again.precision.params, strict=True):
        assert torch.equal(m, m2)
        for key, value in opt.state[m].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt2.state[m2][key]))
    for p, p2 in zip(parts.precision.model, again.precision.model, strict=True):
        assert torch.equal(p, p2)
    for k in (2, 3):
        _step(parts, opt, sched, k)
        _step(again, opt2, sched2, k)
    for p, p2 in zip(parts.precision.params, again.precision.params, strict=True):
        assert torch.equal(p, p2)


def test_what_a_checkpoint_holds_and_its_info(world_of_one, tmp_path: Path) -> None:
    """Kills: a pure model saving `master/` keys (or a mixed one none), a moment saved
    whole when it is a scalar (AdamW's step), the info's mesh / schedule / dtype / step
    changed, the trainer's data position not the step."""
    import torch.distributed.checkpoint as dcp

    for dtype, masters in ((torch.float32, False), (torch.bfloat16, True)):
        parts, opt, sched = _trainer(dtype, seed=2)
        _step(parts, opt, sched, 0)
        path = sharded.save(parts, opt, sched, 1, tmp_path / str(dtype))
        keys = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        assert ("master/embed.weight" in keys) == masters
        assert {"model/embed.weight", "optim/embed.weight/exp_avg",
                "optim/embed.weight/exp_avg_sq", "optim/embed.weight/step",
                "optim/norm.weight/hparams", "scheduler", "trainer", "rng/rank0"} <= keys
        info = json.loads((path / "stp.json").read_text())
        assert info == {"step": 1, "pp": 1, "tp": 1, "dp": 1, "schedule": "1f1b",
                        "dtype": str(dtype).removeprefix("torch."), "model": None}
        state, _ = sharded._save_state(parts, opt, sched, 1)
        assert state["trainer"] == {"step": 1, "data_position": 1}


def test_keep_drops_the_oldest_and_a_resave_replaces(world_of_one, tmp_path: Path) -> None:
    """Kills: `keep` keeping the oldest or one too many, a re-saved step not replaced
    (or its old copy left beside it), keep 0 accepted, a leftover partial not removed."""
    parts, opt, sched = _trainer(torch.float32, seed=3)
    with pytest.raises(ValueError, match="keep must be >= 1 .* got 0"):
        sharded.save(parts, opt, sched, 1, tmp_path, keep=0)
    (tmp_path / ".step-00000003.partial").mkdir(parents=True)
    (tmp_path / ".step-00000003.partial" / "junk").write_text("x")
    for step in (1, 2, 3):
        sharded.save(parts, opt, sched, step, tmp_path, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000002", "step-00000003"]
    _step(parts, opt, sched, 0)
    sharded.save(parts, opt, sched, 3, tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    again, opt2, sched2 = _trainer(torch.float32, seed=3)
    sharded.load(again, opt2, sched2, tmp_path / "step-00000003")
    assert sched2.last_epoch == 1  # the re-saved one


def test_latest_and_the_complete_checkpoints(tmp_path: Path) -> None:
    """Kills: an incomplete directory (no .metadata or no stp.json) counted, a name
    without digits accepted, sorting by name instead of number, `latest` taking the
    oldest (or the second: five complete ones here), the refusal's wording (missing
    vs empty), read_info reading another file than the checkpoint's stp.json."""
    def make(name: str, metadata: bool = True, info: bool = True) -> Path:
        p = tmp_path / name
        p.mkdir()
        if metadata:
            (p / ".metadata").write_text("")
        if info:
            (p / "stp.json").write_text("{}")
        return p

    assert sharded.complete_checkpoints(tmp_path / "nowhere") == []
    (make("step-00000009") / "stp.json").write_text('{"step": 9, "pp": 2}')
    make("step-00000100")
    make("step-00000010")
    make("step-20000000")
    make("step-100000000")  # past 8 digits: by name it sorts before step-20000000
    make("step-00000200", metadata=False)
    make("step-00000300", info=False)
    make("step-x")
    (tmp_path / "step-00000400").write_text("a file")
    assert [p.name for p in sharded.complete_checkpoints(tmp_path)] == [
        "step-00000009", "step-00000010", "step-00000100", "step-20000000", "step-100000000"]
    assert sharded.read_info(tmp_path / "step-00000009") == {"step": 9, "pp": 2}
    assert sharded.latest(tmp_path).name == "step-100000000"
    assert sharded.latest(tmp_path / "step-00000009").name == "step-00000009"
    with pytest.raises(ValueError, match=r"'.*nowhere' does not exist: give a checkpoint"):
        sharded.latest(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"holds no complete checkpoint: give a checkpoint "
                                         r"directory \(step-N with .metadata and stp.json\)"):
        sharded.latest(empty)
    assert sharded.checkpoint_name(42) == "step-00000042"


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter() -> None:
    """Kills: the refusal's message lost when a parameter of this model is not in the
    checkpoint (a user would not learn which parameter, nor why)."""
    parts, _, _ = _trainer(torch.float32, seed=4)
    with pytest.raises(ValueError) as err:
        sharded._load_state(parts, {"model/other.weight": None}, "'ckpt/step-00000001'")
    assert str(err.value) == ("checkpoint 'ckpt/step-00000001' has no parameter "
                              "'embed.weight': it was saved from another model")


def test_weights_without_optimizer_state_load_the_weights_alone() -> None:
    """Kills: a parameter with no `optim/` key in the checkpoint (weights written
    without optimizer state) failing the load (`optim.get(name)` without its empty
    default) instead of asking for its weights alone."""
    parts, _, _ = _trainer(torch.float32, seed=4)
    keys = {"model/embed.weight": None, "model/norm.weight": None}
    state, boxes, wholes = sharded._load_state(parts, keys, "'w'")
    assert sorted(state) == sorted(boxes) == ["model/embed.weight", "model/norm.weight"]
    assert wholes == {}


def test_an_empty_shard_still_asks_for_its_scalar_state() -> None:
    """Kills: a DP shard holding no rows (rank 1 of 2, a one-row parameter) skipping
    the rest of its optimizer state after the first moment (`continue` made `break`):
    AdamW's step would not be restored on that rank."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    from stp.train.step.zero import DPGroup, ShardedPrecision

    params = {"embed.weight": nn.Parameter(torch.zeros(1, 3))}
    prec = ShardedPrecision(list(params.items()), [], DPGroup(2, 1, None, lambda *a, **k: None))
    parts = SimpleNamespace(stages={0: _Stage(params)}, precision=prec,
                            dims=SimpleNamespace(pp=1, tp=1, dp=2),
                            mesh=SimpleNamespace(rank=1, coord=SimpleNamespace(tp=0)))
    f32 = TensorProperties(dtype=torch.float32)
    rows = TensorStorageMetadata(f32, torch.Size([1, 3]), [])
    keys = {"model/embed.weight": rows, "optim/embed.weight/exp_avg": rows,
            "optim/embed.weight/step": TensorStorageMetadata(f32, torch.Size([]), [])}
    state, _, wholes = sharded._load_state(parts, keys, "'c'")
    assert sorted(state) == ["optim/embed.weight/step"]
    assert wholes["optim/embed.weight/exp_avg"].shape == (0, 3)
    assert wholes["optim/embed.weight/step"].shape == ()


def test_loaded_state_moves_to_the_parameters_device_but_the_step() -> None:
    """Kills: loaded moments left on the host (not moved to the parameter's device:
    here torch's meta device, so a CPU tensor shows), AdamW's scalar step moved with
    them (it stays on the host), a parameter group without saved hyperparameters
    failing the load (`next` without its default)."""
    params = {"embed.weight": nn.Parameter(torch.zeros(4, 3, device="meta"))}
    prec = Precision(list(params.items()))
    opt = torch.optim.AdamW(prec.params, lr=0.5)
    parts = SimpleNamespace(stages={0: _Stage(params)}, precision=prec,
                            dims=SimpleNamespace(tp=1),
                            mesh=SimpleNamespace(coord=SimpleNamespace(tp=0)))
    state = {"optim/embed.weight/exp_avg": torch.ones(4, 3),
             "optim/embed.weight/step": torch.tensor(3.0), "model/embed.weight": None}
    sharded._apply_optimizer_state(parts, opt, state)
    loaded = opt.state[prec.params[0]]
    assert loaded["exp_avg"].device.type == "meta" and loaded["step"].device.type == "cpu"
    assert opt.param_groups[0]["lr"] == 0.5


def test_optimizer_state_keys_and_targets() -> None:
    """Kills: _optim_keys splitting the name wrong or taking non-optim keys, a state
    target not zero where the box holds padding, a scalar state given a tensor, the
    target of a transposed parameter's state made with its strides, not contiguous."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from stp.train.checkpoint.shards import Box

    keys = ["model/a", "optim/a/exp_avg", "optim/a/step", "optim/b.c/exp_avg", "scheduler"]
    assert sharded._optim_keys(keys) == {"a": ["optim/a/exp_avg", "optim/a/step"],
                                         "b.c": ["optim/b.c/exp_avg"]}
    opt = torch.ones(3, 2)
    box = Box(torch.Size([3, 2]), torch.Size([0, 0]))
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([3, 2]), [])
    whole, target = sharded._state_target(md, opt, box)
    assert torch.equal(whole, torch.zeros(3, 2)) and target.data_ptr() == whole.data_ptr()
    scalar = TensorStorageMetadata(TensorProperties(dtype=torch.float64), torch.Size([]), [])
    whole, target = sharded._state_target(scalar, opt, box)
    assert whole.shape == () and whole.dtype == torch.float64 and target is whole
    assert sharded._state_target(BytesStorageMetadata(), opt, box) == (None, None)
    whole, _ = sharded._state_target(md, torch.ones(2, 3).t(), box)
    assert whole.is_contiguous()  # a fresh contiguous buffer, whatever the strides


def test_an_unwritable_directory_is_refused_naming_flag_and_path(tmp_path: Path) -> None:
    """Kills: an unwritable --out accepted or its message losing the flag / path, a
    missing directory not created."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"^--save-dir '.*file/sub' is not a writable "
                                         r"directory: "):
        checks.check_writable(blocker / "sub", "--save-dir")
    checks.check_writable(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir()
