"""`stp train` leaves the sharded checkpoint and nothing gathered; `--save-full PATH`
writes the whole model as one safetensors file, stage by stage.

- On pp2 x tp2 (schedule stp; a vocabulary of 31 padded to 32, one kv head
  replicated on both TP ranks) and pp2 x dp2 (1f1b), one 4-process launch:
  `Trainer.save_full` equals `Trainer.full_state_dict()` exactly, names, dtypes
  (float64, bfloat16) and bytes; untrained, it equals the single-process
  reference model; `parameter_count()` counts what full_state_dict holds;
  `Trainer.save_hf`'s files (streamed one tensor at a time) hold the same.
- The file is safetensors (a length and a JSON header, no pickle) and
  `safetensors.torch.load_file` reads it.
- The command line: no `checkpoint.pt` by default, the summary names the
  sharded checkpoint; `--save-full` refused before any step when its directory
  cannot take the file; a full disk is one line naming the file, the partial
  removed and an earlier file at PATH untouched.
"""

from __future__ import annotations

import errno
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_dist
from safetensors.torch import load_file

from stp.cli.main import main
from stp.models import ModelConfig, build_reference
from stp.models.hf import hf_name, stream

CONFIG = ModelConfig(vocab_size=31, hidden=32, num_layers=4, num_heads=4, num_kv_heads=1,
                     ffn_hidden=64, max_seq_len=8, seed=5)
MESHES = {(2, 2, 1): "stp", (2, 1, 2): "1f1b"}
SHAPE = ["--pp", "1", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
         "--microbatch-size", "1", "-m", "2", "--steps", "1", "--timeout", "60"]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, CONFIG.vocab_size, (8, 9), generator=torch.Generator().manual_seed(1))
    return tok[:, :-1], tok[:, 1:]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _differences(path: Path, want: dict[str, torch.Tensor]) -> list[str]:
    """What differs between the file and `want` (empty: the same bytes)."""
    got = load_file(path)
    if sorted(got) != sorted(want):
        return [f"names {sorted(set(got) ^ set(want))}"]
    return [n for n, t in want.items()
            if got[n].dtype != t.dtype or got[n].shape != t.shape or not torch.equal(got[n], t)]


def _hf_differences(directory: Path, full: dict[str, torch.Tensor]) -> list[str]:
    """What differs between a --save-hf directory's files and `full` (several files)."""
    files = sorted(directory.glob("model-*.safetensors"))
    got = {k: v for f in files for k, v in load_file(f).items()}
    want = {hf_name(n): t for n, t in full.items()}
    if len(files) < 2 or sorted(got) != sorted(want):
        return [f"{len(files)} files, names {sorted(set(got) ^ set(want))}"]
    return [n for n, t in want.items() if got[n].dtype != t.dtype or not torch.equal(got[n], t)]


def _worker(rank: int, world: int, out_dir: str) -> dict:
    from stp.runtime.mesh import Mesh, ParallelDims
    from stp.train.step.trainer import Trainer

    out: dict[str, object] = {}
    for dims, schedule in MESHES.items():
        mesh = Mesh.from_world(ParallelDims(*dims), timeout=60)
        for dtype in (torch.float64, torch.bfloat16) if dims == (2, 2, 1) else (torch.float64,):
            key = f"{dims} {dtype}"
            trainer = Trainer(CONFIG, _sgd, schedule, mesh=mesh, microbatches=4, dtype=dtype,
                              timeout=60)
            path = Path(out_dir) / f"{dims[0]}{dims[1]}{dims[2]}-{dtype}.safetensors"
            if dtype == torch.float64:  # untrained: the reference model's initial values
                trainer.save_full(path)
                ref = {n: p.detach() for n, p in build_reference(CONFIG, dtype).named_parameters()}
                out[f"{key} init"] = _differences(path, ref) if rank == 0 else None
            trainer.step(_batch())
            trainer.save_full(path)  # over the earlier file
            full = trainer.full_state_dict()
            count = trainer.parameter_count()
            if dims == (2, 2, 1):  # --save-hf streams its files one tensor at a time too
                trainer.save_hf(Path(out_dir) / f"hf-{dtype}", max_shard_bytes=20_000)
            if rank == 0:
                out[key] = _differences(path, full)
                out[f"{key} hf"] = _hf_differences(Path(out_dir) / f"hf-{dtype}", full) if (
                    dims == (2, 2, 1)) else []
                out[f"{key} count"] = (count, sum(t.numel() for t in full.values()))
                out[f"{key} dtypes"] = sorted({str(t.dtype) for t in load_file(path).values()})
    return out


def test_save_full_equals_full_state_dict_on_meshes(tmp_path: Path) -> None:
    results = run_dist(_worker, 4, str(tmp_path), timeout=300)[0]
    for dims in MESHES:
        assert results[f"{dims} torch.float64 init"] == [], dims
        assert results[f"{dims} torch.float64"] == [], dims
        count, held = results[f"{dims} torch.float64 count"]
        assert count == held > 0
        assert results[f"{dims} torch.float64 dtypes"] == ["torch.float64"]
    assert results["(2, 2, 1) torch.float64 hf"] == []
    assert results["(2, 2, 1) torch.bfloat16 hf"] == []
    assert results["(2, 2, 1) torch.bfloat16"] == []
    assert results["(2, 2, 1) torch.bfloat16 dtypes"] == ["torch.bfloat16"]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [  # no partial left
        "212-torch.float64.safetensors", "221-torch.bfloat16.safetensors",
        "221-torch.float64.safetensors"]
    assert not list(tmp_path.glob(".*"))


def _train(capfd, *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    got = capfd.readouterr()
    return code, got.out, got.err


def test_the_default_run_writes_the_sharded_checkpoint_only(tmp_path, capfd) -> None:
    code, out, err = _train(capfd, *SHAPE, "--out", str(tmp_path))
    assert code == 0, err
    assert f"checkpoint: {tmp_path / 'step-00000001'} (sharded" in out
    assert not (tmp_path / "checkpoint.pt").exists()
    assert not list(tmp_path.glob("*.safetensors"))


def test_save_full_from_the_command_line_is_safetensors(tmp_path, capfd) -> None:
    path = tmp_path / "model.safetensors"
    code, out, err = _train(capfd, *SHAPE, "--out", str(tmp_path / "run"), "--dtype",
                            "bfloat16", "--save-full", str(path))
    assert code == 0, err
    assert f"whole model (safetensors): {path}" in out
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + size])  # a JSON header, then the tensors: no pickle
    assert head["__metadata__"]["format"] == "pt"
    assert json.loads(head["__metadata__"]["stp_model_config"])["hidden"] == 32
    tensors = load_file(path)
    names = {n for n, _ in build_reference(
        ModelConfig(vocab_size=256, hidden=32, num_layers=2, num_heads=2)).named_parameters()}
    assert set(tensors) == names
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert f"{sum(t.numel() for t in tensors.values()):,} parameters" in out
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


@pytest.mark.parametrize("where,message", [
    ("dir", "is a directory; give a file name"),
    ("missing/m.safetensors", "does not exist"),
    pytest.param("/proc/m.safetensors", "cannot write in '/proc'",
                 marks=pytest.mark.skipif(not sys.platform.startswith("linux"),
                                          reason="/proc")),
])
def test_an_unwritable_save_full_is_refused_before_training(tmp_path, capfd, monkeypatch,
                                                            where, message) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir").mkdir()
    code, out, err = _train(capfd, *SHAPE, "--save-full", where)
    assert code == 2
    assert err.count("\n") == 1 and "--save-full" in err and message in err, err
    assert not (tmp_path / "runs").exists() and "trained" not in out  # no run started


def test_save_full_with_emulated_compute_is_refused(capfd) -> None:
    code, _, err = _train(capfd, "--emulate-compute", "f=1,b=1,w=1", "--save-full", "m.st")
    assert code == 2 and err.count("\n") == 1 and "--emulate-compute" in err, err


_real_pwrite_all = stream._pwrite_all


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _no_space_for_tensors(fd, data, offset):
    if offset:  # the header (offset 0) fits, the first tensor does not
        _no_space()
    _real_pwrite_all(fd, data, offset)


@pytest.mark.parametrize("patched", ["_reserve", "_pwrite_all"])
def test_a_full_disk_while_writing_save_full_is_one_line(tmp_path, capfd, monkeypatch,
                                                         patched) -> None:
    monkeypatch.setattr(stream, patched,
                        _no_space if patched == "_reserve" else _no_space_for_tensors)
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"an earlier file")
    code, _, err = _train(capfd, *SHAPE, "--out", str(tmp_path / "run"), "--save-full",
                          str(path))
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if "--save-full" in ln]
    assert len(lines) == 1 and "no space left on device" in lines[0], err
    assert str(path) in lines[0] and "Traceback" not in err
    assert path.read_bytes() == b"an earlier file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "run"]  # no partial
    assert (tmp_path / "run" / "step-00000001").is_dir()  # the sharded checkpoint stands
