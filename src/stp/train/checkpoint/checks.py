"""The checks a run makes of its checkpoints before any worker starts: the output
directory can be written, and the checkpoint `--resume` names is whole, verified,
finite and of this model (stp.train.checkpoint.sharded writes and loads them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stp.train.checkpoint import integrity
from stp.train.checkpoint.sharded import INFO, latest, read_info
from stp.train.step import finite

__all__ = ["check_resume", "check_writable"]


def check_writable(path: str | Path, flag: str = "--out") -> None:
    """Create directory `path` and write a probe file in it; ValueError naming the
    path and the reason when that fails (before any step is lost)."""
    import tempfile

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".stp-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {str(path)!r} is not a writable directory: "
                         f"{e.strerror or e}") from None


def check_resume(path: str | Path, model: dict[str, Any] | None, *,
                 allow_unverified: bool = False) -> Path:
    """The checkpoint `--resume path` would load; ValueError when there is none, when it
    has no manifest (unless `allow_unverified`), or when its model shape differs from
    `model` (dataclasses.asdict of a ModelConfig)."""
    found = latest(path)
    # checksums and .metadata, before any worker starts
    integrity.verify(found, allow_unverified=allow_unverified)
    finite.scan_dcp(found)  # NaN/inf weights: one line now, not a run that trains nothing
    saved = read_info(found).get("model")
    if saved is not None and not isinstance(saved, dict):
        raise ValueError(f"{found / INFO}: its model is not a JSON object (damaged)")
    if saved is not None and model is not None:
        for key in sorted(set(saved) | set(model)):
            if key != "seed" and saved.get(key) != model.get(key):
                raise ValueError(f"--resume {str(path)!r}: checkpoint {found.name} has model "
                                 f"{key}={saved.get(key)!r}, this run {model.get(key)!r}")
    return found
