"""Checksums of a sharded checkpoint, written with it and verified before a resume.

A flipped bit inside a weight's bytes, a shard cut short by a full disk or a
copy, a deleted data file: DCP would load the first silently (a resumed run
with a different model) and fail on the others with a long traceback. So
every checkpoint holds `MANIFEST`, the sha256 and size of each of its files:

* `shard_digests(tmp)` (collective, after dcp.save): each rank hashes the data
  files it wrote itself (`__<rank>_*.distcp`, so the hashing is spread over the
  ranks), rank 0 also `.metadata`; rank 0 gets them all.
* `write_manifest(tmp, digests)` (rank 0, after stp.json, before the rename
  that publishes the checkpoint): adds stp.json and writes the manifest.
* `verify(path)` before anything is loaded (the launcher's checks and
  stp.train.checkpoint.sharded.load): every file the manifest lists must be there with
  its size and digest, and every data file `.metadata` names must exist and
  hold the bytes it points into. Any failure is one line naming the file and the
  newest earlier step of the same directory that verifies.

A checkpoint without a manifest is refused: deleting the manifest must not
switch the check off. One written before stp wrote manifests is accepted with
`allow_unverified` (`stp train --allow-unverified`) and a one-line warning: its
files are then checked for presence and size against `.metadata` only. The
manifest protects against damage, not against someone who can write the
directory (they can rewrite the manifest too): stp never runs code from a
checkpoint (stp.train.checkpoint.read), but trusts its numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST", "DamagedCheckpoint", "shard_digests", "write_manifest", "verify",
           "verify_everywhere", "file_digest"]

MANIFEST = "stp.sha256.json"
_CHUNK = 1 << 20
_verified: dict[tuple[Any, ...], None] = {}
"""Checkpoints this process verified, keyed by every file's (name, size, mtime): the
local launcher's check and a single-process run's load hash a checkpoint once."""


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match its manifest or its index."""

    agreed = True
    """Raised alike on every rank (a collective verdict): rank 0 alone reports it."""


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": file_digest(path)}


def shard_digests(tmp: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Collective after dcp.save into `tmp`: {file name: size and sha256} of every data
    file and `.metadata`, on global rank 0 ({} elsewhere)."""
    import torch.distributed as dist

    root, rank = Path(tmp), dist.get_rank()
    mine = {p.name: _entry(p) for p in sorted(root.glob(f"__{rank}_*.distcp"))}
    if rank == 0 and (root / ".metadata").is_file():
        mine[".metadata"] = _entry(root / ".metadata")
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return {}
    return {name: e for part in everyone for name, e in part.items()}


def write_manifest(tmp: str | os.PathLike[str], digests: dict[str, dict[str, Any]]) -> None:
    """Rank 0: the manifest of `tmp` from `digests` plus the files rank 0 wrote since
    (stp.json); written before the checkpoint is published (renamed)."""
    root = Path(tmp)
    files = dict(digests)
    for p in root.iterdir():
        if p.is_file() and p.name not in files and p.name != MANIFEST:
            files[p.name] = _entry(p)
    text = json.dumps({"algorithm": "sha256", "files": dict(sorted(files.items()))}, indent=1)
    (root / MANIFEST).write_text(text + "\n")


def _read_manifest(path: Path) -> dict[str, dict[str, Any]] | None:
    file = path / MANIFEST
    if not file.exists():
        return None
    try:
        if not file.is_file() or file.stat().st_size > 64 << 20:  # no device, no giant
            raise TypeError
        raw = json.loads(file.read_bytes())
        files = raw["files"]
        if raw.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise TypeError
        for name, e in files.items():
            if (not isinstance(name, str) or "/" in name or name in ("", ".", "..")
                    or not isinstance(e, dict) or not isinstance(e.get("sha256"), str)
                    or isinstance(e.get("size"), bool) or not isinstance(e.get("size"), int)):
                raise TypeError
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        raise DamagedCheckpoint(f"{file} is damaged (not the checksum list stp writes)") from None
    return files


def _problem(path: Path) -> str | None:
    """What is wrong with checkpoint directory `path` (one line naming the file), or None."""
    from stp.train.checkpoint.read import read_metadata

    try:
        files = _read_manifest(path)
    except DamagedCheckpoint as e:
        return str(e)
    if files is not None:
        for name, entry in files.items():
            f = path / name
            if not f.is_file():
                return f"{f} is missing"
            size = f.stat().st_size
            if size != entry["size"]:
                return (f"{f} holds {size} bytes, {entry['size']} were written (truncated or "
                        "damaged)")
            if file_digest(f) != entry["sha256"]:
                return f"{f} does not match its checksum in {MANIFEST} (damaged)"
    try:
        md = read_metadata(path)
    except ValueError as e:
        return str(e)
    needed: dict[str, int] = {}
    for info in md.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        f = path / name
        if not f.is_file():
            return f"{f} is missing (named in {path / '.metadata'})"
        if files is not None and name not in files:
            return f"{f} is not in {MANIFEST} (not written with this checkpoint)"
        if f.stat().st_size < end:
            return f"{f} holds {f.stat().st_size} bytes, .metadata points up to byte {end} " \
                   "(truncated)"
    return None


def _key(path: Path) -> tuple[Any, ...]:
    try:
        return (str(path.resolve()),) + tuple(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir()))
    except OSError:
        return (str(path), None)


def complete_steps(directory: Path) -> list[Path]:
    """The complete `step-N` checkpoints in `directory`, oldest first (as
    stp.train.checkpoint.sharded.complete_checkpoints, which imports this module)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.name.startswith("step-")
             and p.name[5:].isdigit() and (p / ".metadata").is_file()
             and (p / "stp.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _earlier_intact(path: Path) -> str:
    """`; the earlier step-N is intact (...)` or `; no earlier complete step is intact`."""
    step = path.name
    for older in reversed(complete_steps(path.parent)):
        if older.name < step and _problem(older) is None:
            return f"; the earlier {older} is intact: resume from it with --resume {older}"
    return "; no earlier complete step in its directory is intact"


def verify(path: str | os.PathLike[str], warn: Any = None, *,
           allow_unverified: bool = False) -> None:
    """DamagedCheckpoint (a ValueError, one line) unless checkpoint directory `path`
    matches its manifest and its index; see the module doc. A checkpoint without a
    manifest is refused, or with `allow_unverified` passes with a warning (to stderr, or
    `warn(line)`)."""
    p = Path(path)
    key = _key(p)
    if key in _verified:
        return
    problem = _problem(p)
    if problem is not None:
        raise DamagedCheckpoint(f"checkpoint {p} refused: {problem}{_earlier_intact(p)}")
    if not (p / MANIFEST).exists():
        if not allow_unverified:
            raise DamagedCheckpoint(
                f"checkpoint {p} refused: it has no {MANIFEST}, so its bytes cannot be checked "
                "(the manifest was deleted, or an stp older than checksums wrote it); give "
                "--allow-unverified to resume from it anyway")
        line = (f"stp: warning: checkpoint {p} has no {MANIFEST} (--allow-unverified): "
                "its files are checked against .metadata but not for damaged bytes")
        (warn or (lambda s: print(s, file=sys.stderr, flush=True)))(line)
    _verified[key] = None


def verify_everywhere(path: str | os.PathLike[str], *, allow_unverified: bool = False) -> None:
    """Collective `verify`: global rank 0 checks, every rank raises its verdict (so no
    rank reads a damaged file, and none waits in a collective the others left)."""
    import torch.distributed as dist

    error = None
    if dist.get_rank() == 0:
        try:
            verify(path, allow_unverified=allow_unverified)
        except ValueError as e:
            error = str(e)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise DamagedCheckpoint(box[0])
