"""Reading a DCP checkpoint without running code from it.

torch.distributed.checkpoint's FileSystemReader reads `.metadata` with a plain
`pickle.load`, and its default load planner reads every non-tensor value (the
LR scheduler's state, RNG states, optimizer hyperparameters) with
`torch.load(weights_only=False)`: a checkpoint directory from anyone else could
run any code on every rank that resumes from it. stp reads both ways restricted:

* `.metadata` through `SafeReader.read_metadata`: an unpickler whose
  `find_class` admits only DCP's metadata classes and the few plain types they
  hold (torch.Size, dtypes, the layout lookup, PosixPath). A pickle naming any
  other global is refused in one line naming the file, before anything in it
  is called. The result must be a `Metadata` whose storage entries name plain
  files inside the checkpoint directory (no `../`, no absolute paths).
* non-tensor values through `torch.load(weights_only=True)` (`safe_load_bytes`,
  used by stp.train.checkpoint.shards.BoxLoadPlanner): dicts, lists, numbers, strings,
  tensors; DCP's tensor reads already use weights_only=True.

What is still trusted: the checkpoint's numbers (checked for integrity against
its manifest by stp.train.checkpoint.integrity, and for finite weights on load), not its
authors' intentions: a checkpoint can hold weights that train badly.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["SafeReader", "UnsafeCheckpoint", "read_metadata", "safe_load_bytes"]

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30
"""A `.metadata` above 1 GiB is not one stp wrote (its index of a 1e5-tensor model
is a few MiB): refused before it is read into memory."""

_DCP = "torch.distributed.checkpoint"
# (module, name) the metadata pickle may name; everything else is refused
_ALLOWED: set[tuple[str, str]] = {
    (f"{_DCP}.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    # a layout is pickled as a call of this lookup by name (a dict read, nothing else)
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_DTYPES = {str(v).removeprefix("torch.") for v in vars(torch).values()
           if isinstance(v, torch.dtype)}
_MEMORY_FORMATS = {"contiguous_format", "channels_last", "channels_last_3d",
                   "preserve_format"}


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that would make the reader run code, or is not what it claims."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and (
                name in _DTYPES or name in _MEMORY_FORMATS)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self.where}: refused: its pickle names {module}.{name}, which is not a "
            "checkpoint metadata class (stp never unpickles code from a checkpoint)")


def _check_paths(md: Metadata, where: str) -> None:
    """Every storage entry names a plain file directly in the checkpoint directory."""
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise UnsafeCheckpoint(f"{where}: refused: not a DCP checkpoint index")
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if (not isinstance(rel, str) or not rel or rel.startswith(".") or "\\" in rel
                or len(PurePosixPath(rel).parts) != 1):
            raise UnsafeCheckpoint(f"{where}: refused: it names data file {rel!r}, which is "
                                   "not a file of this checkpoint directory")
        for field in ("offset", "length"):
            value = getattr(info, field, None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UnsafeCheckpoint(f"{where}: refused: data file {rel!r} has {field} "
                                       f"{value!r}")


def read_metadata(path: str | os.PathLike[str], rank: int | None = None) -> Metadata:
    """The DCP index of checkpoint directory `path`, unpickled with the allow-list;
    UnsafeCheckpoint (a ValueError) naming the file for anything else, a missing or
    unreadable file, or a truncated / damaged pickle."""
    file = Path(path) / (METADATA if rank is None else f"__{rank}{METADATA}")
    where = str(file)
    try:
        st = file.stat()
        if not stat.S_ISREG(st.st_mode):  # a device or pipe would be read forever
            raise UnsafeCheckpoint(f"{where}: refused: not a regular file")
        if st.st_size > MAX_METADATA_BYTES:
            raise UnsafeCheckpoint(f"{where}: refused: {st.st_size} bytes, more than a "
                                   "checkpoint index holds")
        with open(file, "rb") as fh:
            data = fh.read(MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise UnsafeCheckpoint(f"{where}: cannot read the checkpoint index: "
                               f"{e.strerror or e}") from None
    try:
        md = _MetadataUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - any damage to the pickle: one line
        text = " ".join(str(e).split())[:120]  # one line, whatever the error says
        raise UnsafeCheckpoint(f"{where}: damaged checkpoint index "
                               f"({type(e).__name__}: {text})") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpoint(f"{where}: refused: holds a {type(md).__name__}, not a DCP "
                               "checkpoint index")
    _check_paths(md, where)
    return md


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` read admits only the metadata classes
    (see the module doc). Use it wherever stp loads a DCP checkpoint."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(self.path, kwargs.get("rank"))
        meta = md.storage_meta or StorageMeta()
        meta.load_id = self.load_id  # as FileSystemReader does
        md.storage_meta = meta
        return md


def safe_load_bytes(value: io.BytesIO, fqn: str) -> Any:
    """A non-tensor value of a checkpoint (scheduler, RNG, hyperparameters), read with
    torch's weights-only unpickler: plain containers, numbers, strings, tensors."""
    try:
        return torch.load(value, weights_only=True)
    except Exception:  # noqa: BLE001 - torch's message advises weights_only=False,
        # which must never reach a user: the value is refused instead
        raise UnsafeCheckpoint(f"checkpoint value {fqn!r} refused: it is not plain data "
                               "(containers, numbers, strings, tensors)") from None
