"""Checkpoints that cannot run code or lie (stp.train.checkpoint.read,
stp.train.checkpoint.integrity).

A tiny single-process Trainer writes step-1 and step-2; each test damages a copy:
a `.metadata` whose pickle would run a payload runs nothing and is refused, a
flipped bit, a cut or deleted shard, a file `.metadata` names that is missing
are refused in one line naming the file and the earlier intact step."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stp.models import ModelConfig
from stp.models.decoder.family import DECODER
from stp.train.checkpoint import checks, integrity
from stp.train.checkpoint import sharded as checkpoint
from stp.train.checkpoint.read import SafeReader, UnsafeCheckpoint, read_metadata, safe_load_bytes
from stp.train.step.trainer import Trainer

CONFIG = ModelConfig(vocab_size=32, hidden=16, num_layers=2, num_heads=2, num_kv_heads=2,
                     ffn_hidden=32, max_seq_len=16, seed=3)
STEP1, STEP2 = "step-00000001", "step-00000002"


def _trainer() -> Trainer:
    return Trainer(CONFIG, None, "1f1b", pp=1, microbatches=2)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(step))
    return tok[:, :-1], tok[:, 1:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ckpt") / "run"
    trainer = _trainer()
    for step in range(2):
        trainer.step(_batch(step))
        trainer.save(str(root))
    return root


@pytest.fixture
def run(saved: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


class Payload:
    """Unpickling this calls os.system: it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refusal(fn, *args) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args)
    text = str(e.value)
    assert "\n" not in text and "weights_only" not in text
    return text


def test_a_saved_checkpoint_has_a_manifest_and_verifies(run: Path) -> None:
    for step in (STEP1, STEP2):
        assert (run / step / integrity.MANIFEST).is_file()
        integrity.verify(run / step)
    assert checks.check_resume(run, None).name == STEP2


def test_a_metadata_payload_runs_nothing_and_is_refused(run: Path, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    (run / STEP2 / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    (run / STEP2 / integrity.MANIFEST).unlink()  # past the checksums: the unpickler itself
    line = _refusal(read_metadata, run / STEP2)
    assert "posix.system" in line and ".metadata" in line
    line = _refusal(checks.check_resume, run, None)
    assert f"{STEP1} is intact" in line
    with pytest.raises(UnsafeCheckpoint):
        SafeReader(run / STEP2).read_metadata()
    with pytest.raises(ValueError, match="posix.system"):
        Trainer.resume(str(run / STEP2), CONFIG, None, "1f1b", pp=1, microbatches=2)
    assert not marker.exists()


@pytest.mark.parametrize("payload", ["exec", "eval", "getattr"])
def test_other_globals_are_refused_by_name(tmp_path: Path, payload: str) -> None:
    (tmp_path / ".metadata").write_bytes(
        f"cbuiltins\n{payload}\n(Vprint(1)\ntR.".encode())
    assert f"builtins.{payload}" in _refusal(read_metadata, tmp_path)


def test_a_value_payload_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save({"lr": Payload(marker)}, buf)
    buf.seek(0)
    assert "scheduler" in _refusal(safe_load_bytes, buf, "scheduler")
    assert not marker.exists()


def test_a_data_file_outside_the_directory_is_refused(run: Path) -> None:
    md = read_metadata(run / STEP2)
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (run / STEP2 / ".metadata").write_bytes(pickle.dumps(md))
    assert "../../etc/passwd" in _refusal(read_metadata, run / STEP2)


@pytest.mark.parametrize("content", [b"", b"\x80", b"\x80\x04K\x01.", b"garbage" * 10])
def test_a_damaged_metadata_is_one_line(tmp_path: Path, content: bytes) -> None:
    (tmp_path / ".metadata").write_bytes(content)
    assert ".metadata" in _refusal(read_metadata, tmp_path)


def test_a_flipped_bit_names_the_file_and_the_intact_step(run: Path) -> None:
    shard = run / STEP2 / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    line = _refusal(checks.check_resume, run, None)
    assert "__0_0.distcp" in line and "checksum" in line
    assert f"{run / STEP1} is intact" in line
    with pytest.raises(ValueError, match="checksum"):
        Trainer.resume(str(run), CONFIG, None, "1f1b", pp=1, microbatches=2)


def test_a_truncated_or_deleted_shard_names_the_file(run: Path) -> None:
    shard = run / STEP2 / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert "truncated" in _refusal(integrity.verify, run / STEP2)
    shard.unlink()
    assert "__0_0.distcp is missing" in _refusal(integrity.verify, run / STEP2)


def test_both_damaged_says_no_step_is_intact(run: Path) -> None:
    for step in (STEP1, STEP2):
        (run / step / "__0_0.distcp").unlink()
    assert "no earlier complete step" in _refusal(checks.check_resume, run, None)


def test_without_a_manifest_a_missing_data_file_is_still_found(run: Path) -> None:
    (run / STEP2 / integrity.MANIFEST).unlink()
    (run / STEP2 / "__0_0.distcp").unlink()
    line = _refusal(integrity.verify, run / STEP2)
    assert "__0_0.distcp is missing (named in" in line


def test_a_deleted_manifest_is_refused_unless_allowed(run: Path) -> None:
    """Guards against deleting stp.sha256.json switching the integrity check off: a
    bit-flipped shard then resumed with exit 0 and a warning."""
    (run / STEP2 / integrity.MANIFEST).unlink()
    line = _refusal(checks.check_resume, run, None)
    assert "no stp.sha256.json" in line and "--allow-unverified" in line
    with pytest.raises(ValueError, match="--allow-unverified"):
        Trainer.resume(str(run), CONFIG, None, "1f1b", pp=1, microbatches=2)


def test_an_old_checkpoint_without_a_manifest_loads_when_allowed(run: Path) -> None:
    (run / STEP2 / integrity.MANIFEST).unlink()
    said: list[str] = []
    integrity.verify(run / STEP2, warn=said.append, allow_unverified=True)
    assert len(said) == 1 and "no stp.sha256.json" in said[0]
    again = Trainer.resume(str(run), CONFIG, None, "1f1b", pp=1, microbatches=2,
                           allow_unverified=True)
    assert again.steps_done == 2


@pytest.mark.parametrize("content", [b"[1, 2]", b"\xff\xfe\x00", b"{", b"3"])
def test_stp_json_that_is_no_object_names_the_file(run: Path, content: bytes) -> None:
    (run / STEP2 / "stp.json").write_bytes(content)
    (run / STEP2 / integrity.MANIFEST).unlink()
    assert "stp.json" in _refusal(lambda: checks.check_resume(
        run / STEP2, {"hidden": 16}, allow_unverified=True))


def test_a_damaged_manifest_is_refused(run: Path) -> None:
    (run / STEP2 / integrity.MANIFEST).write_text("[]")
    assert integrity.MANIFEST in _refusal(integrity.verify, run / STEP2)


TINY = ["train", "--pp", "1", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len",
        "8", "--microbatch-size", "1", "-m", "2", "--timeout", "60"]


def test_stp_train_resume_refuses_a_payload_checkpoint_end_to_end(run: Path,
                                                                 tmp_path: Path) -> None:
    """The CLI as users run it: exit 2, one line, the payload never ran. (The refusal
    comes before the model is compared, so the in-process checkpoint serves.)"""
    data = tmp_path / "data.txt"
    data.write_text(Path(checkpoint.__file__).read_text()[:3000])
    marker = tmp_path / "PWNED"
    (run / STEP2 / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    (run / STEP2 / integrity.MANIFEST).unlink()
    again = subprocess.run([sys.executable, "-m", "stp.cli.main", *TINY, "--steps", "3",
                            "--data", str(data), "--resume", str(run), "--out", str(run)],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 2
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "posix.system" in lines[0] and STEP1 in lines[0]
    assert not marker.exists()


# -- one run per --out ---------------------------------------------------------------------

HOLDER = """
import sys, time
from stp.train.run.outlock import hold_out
hold_out(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def held(tmp_path: Path):
    """--out locked by another live process: (directory, its process id)."""
    out = tmp_path / "shared-out"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    yield out, proc.pid
    proc.kill()
    proc.wait()


def test_a_second_run_on_one_out_is_refused_naming_the_holder(held) -> None:
    from stp.train.run.outlock import OutInUse, hold_out

    out, pid = held
    with pytest.raises(OutInUse) as e:
        hold_out(out)
    assert f"process {pid}" in str(e.value) and "\n" not in str(e.value)


def test_stp_train_and_resume_into_a_locked_out_exit_2(held, saved: Path, capfd) -> None:
    out, pid = held
    shutil.copytree(saved, out, dirs_exist_ok=True)  # a resumable run in the directory
    (out / ".step-00000003.partial").mkdir()  # the holder's save in progress
    from stp.cli.main import main

    for extra in (["--out", str(out)], ["--out", str(out), "--resume", str(out)],
                  ["--resume", str(out)]):  # --resume alone continues in that directory
        code = main([*TINY, "--steps", "3", *extra])
        err = capfd.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1
        assert f"in use by another stp run (process {pid})" in err[0]
    # the in-process main above wrote nothing into the other run's directory, and left
    # the other run's partial alone
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step-")) == [STEP1, STEP2]
    assert (out / ".step-00000003.partial").is_dir()


def test_the_lock_goes_with_its_process(tmp_path: Path) -> None:
    from stp.train.run.outlock import hold_out, release_all

    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(60)", ""),
                           str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    hold_out(out)  # the holder exited: no stale lock
    release_all()


# -- a full disk while saving -----------------------------------------------------------


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial(
        run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    from stp.train.checkpoint.storage import StorageFault

    def full(self, plan, planner):
        (Path(self.path) / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    trainer = Trainer.resume(str(run), CONFIG, None, "1f1b", pp=1, microbatches=2)
    trainer.step(_batch(2))
    with pytest.raises(StorageFault) as e:
        trainer.save(str(run))
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line
    assert "no space left on device" in line and str(run / "step-00000003") in line
    assert f"{run / STEP2} is intact" in line
    assert not (run / ".step-00000003.partial").exists()
    assert not (run / "step-00000003").exists()


def test_too_little_free_space_is_refused_before_writing(
        run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    from stp.train.checkpoint import storage

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    trainer = Trainer.resume(str(run), CONFIG, None, "1f1b", pp=1, microbatches=2)
    trainer.step(_batch(2))
    with pytest.raises(storage.StorageFault, match="MiB is free"):
        trainer.save(str(run))
    assert not (run / ".step-00000003.partial").exists()
    need = storage.checkpoint_bytes(DECODER.parameter_count(CONFIG), "float32")
    with pytest.raises(storage.StorageFault, match="--out"):
        storage.check_free_space(run, need)


# -- non-finite weights and skipped steps ---------------------------------------------------


def _poison_step(run: Path) -> None:
    """Write step-3 from a trainer whose embedding holds a NaN, past the save check."""
    from stp.train.step import finite

    trainer = Trainer.resume(str(run), CONFIG, None, "1f1b", pp=1, microbatches=2)
    trainer.step(_batch(2))
    with torch.no_grad():
        dict(trainer.named_parameters())["embed.weight"][0, 0] = float("nan")
    trainer.parts.precision.params[0].data[0, 0] = float("nan")  # the optimizer's copy too
    with pytest.raises(finite.NonFinite, match="embed.weight"):
        trainer.save(str(run))  # never written...
    assert not (run / "step-00000003").exists()
    real = finite.require_finite
    finite.require_finite = lambda named, what: None  # ...unless forced, as an old stp did
    try:
        trainer.save(str(run))
    finally:
        finite.require_finite = real


def test_a_nan_checkpoint_is_refused_before_workers_and_on_load(run: Path) -> None:
    _poison_step(run)
    line = _refusal(checks.check_resume, run, None)
    assert "embed.weight holds NaN" in line
    with pytest.raises(ValueError, match="embed.weight holds NaN"):
        Trainer.resume(str(run), CONFIG, None, "1f1b", pp=1, microbatches=2)


def test_nan_in_a_hugging_face_directory_names_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from stp.models import build_reference
    from stp.models.hf import HFCheckpoint, save_state
    from stp.train.step.finite import scan_hf

    model = build_reference(CONFIG, torch.float32)
    save_state(tmp_path, {n: p.detach() for n, p in model.named_parameters()}, CONFIG)
    f = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(f)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 3] = float("inf")
    save_file(tensors, f, metadata={"format": "pt"})
    ckpt = HFCheckpoint.open(tmp_path)
    assert "model.layers.1.mlp.up_proj.weight" in _refusal(scan_hf, ckpt)
    with pytest.raises(ValueError, match="up_proj.weight holds NaN or inf"):
        Trainer(None, None, "1f1b", pp=1, microbatches=2, init_from=str(tmp_path))


def test_consecutive_skipped_steps_stop_the_run() -> None:
    from stp.train.step.finite import SkipCounter, TooManySkipped

    c = SkipCounter(3)
    for step, skipped in enumerate([True, True, False, True, True], 1):
        c.update(skipped, step)
    with pytest.raises(TooManySkipped, match=r"3 consecutive steps \(4-6\)"):
        c.update(True, 6)
    SkipCounter(0).update(True, 1)  # 0: never


def test_stp_train_with_nan_gradients_exits_non_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd) -> None:
    """Every gradient norm inf (as NaN weights or an overflow make it): the run stops
    after --max-skipped-steps, exit 1, one line; no checkpoint is written."""
    from stp.cli.main import main
    from stp.train.step import grad_sync  # where a step's gradient norm is taken

    # the norm stays a device tensor until the step's one read (stp.train.step.grad_sync)
    monkeypatch.setattr(grad_sync, "global_norm",
                        lambda *a, **k: torch.tensor(float("inf"), dtype=torch.float64))
    data = tmp_path / "data.txt"
    data.write_text(Path(checkpoint.__file__).read_text()[:3000])
    out = tmp_path / "o"
    code = main([*TINY, "--steps", "30", "--data", str(data), "--out", str(out),
                 "--max-skipped-steps", "3", "--save-every", "5", "--json"])
    err = capfd.readouterr().err.strip().splitlines()  # one line, written to fd 2
    assert code == 1
    assert err[-1].startswith("stp: error: 3 consecutive steps (1-3) had inf/NaN gradients")
    assert not list(out.glob("step-*"))


def test_without_a_manifest_damaged_tensor_data_is_one_line(run: Path) -> None:
    """Damage the checksums cannot see (an old checkpoint): torch's reader fails, and
    its advice to pass weights_only=False never reaches the user."""
    step = run / STEP2
    (step / integrity.MANIFEST).unlink()
    md = read_metadata(step)
    info = next(v for k, v in md.storage_data.items() if k.fqn.endswith("/exp_avg"))
    data = bytearray((step / info.relative_path).read_bytes())
    data[info.offset:info.offset + 64] = bytes(64)  # the tensor's zip header
    (step / info.relative_path).write_bytes(bytes(data))
    line = _refusal(lambda: checks.check_resume(run, None, allow_unverified=True))
    assert "exp_avg" in line and info.relative_path in line and "damaged" in line
    with pytest.raises(ValueError) as e:
        Trainer.resume(str(run), CONFIG, None, "1f1b", pp=1, microbatches=2,
                       allow_unverified=True)
    line = str(e.value)
    assert "\n" not in line and "weights_only" not in line
    assert str(step) in line and "damaged" in line


def test_without_a_manifest_damaged_weights_are_refused_before_launch(run: Path) -> None:
    step = run / STEP2
    (step / integrity.MANIFEST).unlink()
    md = read_metadata(step)
    key, info = next((k, v) for k, v in md.storage_data.items() if k.fqn.startswith("model/"))
    data = bytearray((step / info.relative_path).read_bytes())
    data[info.offset:info.offset + 64] = bytes(64)
    (step / info.relative_path).write_bytes(bytes(data))
    line = _refusal(lambda: checks.check_resume(run, None, allow_unverified=True))
    assert key.fqn in line and "damaged" in line


def test_under_torchrun_rank_0_locks_and_stps_own_workers_do_not(
        held, monkeypatch: pytest.MonkeyPatch) -> None:
    from stp.runtime.watch import LAUNCHER_PID_ENV
    from stp.train.run.outlock import lock_error

    out, pid = held
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    assert f"process {pid}" in lock_error(out)  # torchrun's rank 0: refused
    monkeypatch.setenv(LAUNCHER_PID_ENV, "1")
    assert lock_error(out) is None  # a worker of stp's launcher: its launcher holds it


def test_an_index_or_manifest_that_is_a_device_is_refused_not_read_forever(run: Path) -> None:
    for name in (".metadata", integrity.MANIFEST):
        (run / STEP2 / name).unlink()
        (run / STEP2 / name).symlink_to("/dev/zero")
        assert name in _refusal(integrity.verify, run / STEP2)
        (run / STEP2 / name).unlink()
        shutil.copy(run / STEP1 / name, run / STEP2 / name)  # a file again, for the next


@pytest.mark.slow
def test_a_two_rank_resume_from_a_flipped_checkpoint_is_one_line(tmp_path: Path) -> None:
    """stp's launcher with pp 2: refused before any worker starts, exit 2, one line."""
    data = tmp_path / "data.txt"
    data.write_text(Path(checkpoint.__file__).read_text()[:3000])
    out = tmp_path / "out"
    flags = [TINY[0], "--pp", "2", "--schedule", "1f1b", *TINY[3:], "--data", str(data),
             "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run([sys.executable, "-m", "stp.cli.main", *flags, "--steps", "2",
                            "--save-every", "1"], capture_output=True, text=True, timeout=300,
                           env=env)
    assert first.returncode == 0, first.stderr
    shard = out / STEP2 / "__1_0.distcp"
    data_bytes = bytearray(shard.read_bytes())
    data_bytes[len(data_bytes) // 2] ^= 1
    shard.write_bytes(bytes(data_bytes))
    again = subprocess.run([sys.executable, "-m", "stp.cli.main", *flags, "--steps", "3",
                            "--resume", str(out)], capture_output=True, text=True, timeout=300,
                           env=env)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1, again.stderr
    assert "__1_0.distcp does not match its checksum" in lines[0] and STEP1 in lines[0]


@pytest.mark.parametrize("slot", ["exp_avg", "exp_avg_sq"])
def test_nan_in_the_optimizer_state_is_refused_before_launch(tmp_path: Path, slot: str) -> None:
    """Guards against checking only the weights at load: NaN in AdamW's moments (a
    checkpoint whose checksums are intact) was found only when the run refused to save,
    after training steps. The line names the tensor and its shard file."""
    trainer = _trainer()
    trainer.step(_batch(0))
    state = next(iter(trainer.optimizer.state.values()))
    state[slot].view(-1)[0] = float("nan")
    trainer.save(str(tmp_path / "run"))
    line = _refusal(checks.check_resume, tmp_path / "run", None)
    assert slot in line and ".distcp" in line and "NaN or inf" in line
