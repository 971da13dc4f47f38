"""stp.models.hf.slices: a TP rank's slice read with plain reads equals the slice of
the tensor safetensors loads, in every dtype and shard direction, across block
boundaries; damaged or hostile headers and NaN weights are refused in one line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stp.models.decoder.init import ShardSlice, pad_shard
from stp.models.hf import slices
from stp.models.hf.slices import read_header, read_slice

TENSORS = {
    "matrix": torch.randn(37, 24, generator=torch.Generator().manual_seed(0)),
    "cube": torch.randn(6, 10, 3, generator=torch.Generator().manual_seed(1)),
    "vector": torch.randn(29, generator=torch.Generator().manual_seed(2)),
    "scalar": torch.tensor(3.5),
}


def _write(tmp_path: Path, stored_dtype: torch.dtype) -> Path:
    file = tmp_path / f"w-{str(stored_dtype).split('.')[1]}.safetensors"
    save_file({k: v.to(stored_dtype) for k, v in TENSORS.items()}, str(file))
    return file


def _expected(file: Path, key: str, where: ShardSlice, dtype: torch.dtype) -> torch.Tensor:
    with safe_open(file, "pt") as handle:
        full = handle.get_tensor(key)
    if where.dim is not None:
        full = full.narrow(where.dim, where.start, where.stop - where.start)
    return pad_shard(full.to(dtype), where)


WHERES = {
    "matrix": [ShardSlice(None), ShardSlice(0, 10, 25), ShardSlice(0, 30, 37, pad=3),
               ShardSlice(1, 5, 17), ShardSlice(1, 20, 24, pad=2)],
    "cube": [ShardSlice(None), ShardSlice(0, 1, 4), ShardSlice(1, 2, 7, pad=1)],
    "vector": [ShardSlice(None), ShardSlice(0, 8, 20, pad=4)],
    "scalar": [ShardSlice(None)],
}


@pytest.mark.parametrize(("stored_dtype", "dtype"), [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("block_bytes", [1 << 20, 50])  # one block, then a row or two at a time
def test_every_slice_equals_the_slice_of_the_loaded_tensor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored_dtype: torch.dtype,
        dtype: torch.dtype, block_bytes: int) -> None:
    monkeypatch.setattr(slices, "BLOCK_BYTES", block_bytes)
    file = _write(tmp_path, stored_dtype)
    stored = read_header(file)
    assert {k: stored[k].shape for k in TENSORS} == {k: tuple(v.shape) for k, v in TENSORS.items()}
    for key, wheres in WHERES.items():
        for where in wheres:
            got = read_slice(stored[key], where, dtype)
            want = _expected(file, key, where, dtype)
            assert got.dtype == dtype and got.shape == want.shape, (key, where)
            assert torch.equal(got, want), (key, where)


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_a_quantised_dtype_is_refused_naming_it(tmp_path: Path) -> None:
    file = _raw_file(tmp_path / "f8.safetensors",
                     {"w": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(ValueError, match=r"f8.safetensors: tensor 'w' has dtype 'F8_E4M3'; "
                                         r"stp reads F64, F32"):
        read_header(file)


@pytest.mark.parametrize("shape", [[4, 4], [3], [-1, 4], "x", [1] * 9])
def test_a_shape_its_bytes_cannot_hold_is_refused(tmp_path: Path, shape: object) -> None:
    """A shape larger than the byte range would read another tensor's bytes (or past
    the end of the file): refused when the header is read, naming the tensor."""
    file = _raw_file(tmp_path / "lie.safetensors",
                     {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}},
                     b"\0" * 16)
    with pytest.raises(ValueError, match=r"lie.safetensors: not a complete safetensors file "
                                         r"\(tensor 'w' "):
        read_header(file)


@pytest.mark.parametrize(("stored_dtype", "dtype"), [(torch.float32, torch.float32),
                                                     (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("where", [ShardSlice(None), ShardSlice(0, 3, 9), ShardSlice(1, 0, 4)])
def test_nan_or_inf_is_refused_naming_the_tensor(tmp_path: Path, stored_dtype: torch.dtype,
                                                dtype: torch.dtype, where: ShardSlice) -> None:
    w = torch.ones(12, 8)
    w[5, 2] = float("nan")
    w[7, 3] = float("inf")
    file = tmp_path / "bad.safetensors"
    save_file({"w": w.to(stored_dtype)}, str(file))
    with pytest.raises(ValueError, match=r"bad.safetensors: tensor w holds NaN or inf"):
        read_slice(read_header(file)["w"], where, dtype)


def test_nan_outside_the_slice_is_not_this_ranks_concern(tmp_path: Path) -> None:
    w = torch.ones(12, 8)
    w[0, 0] = float("nan")
    file = tmp_path / "w.safetensors"
    save_file({"w": w}, str(file))
    assert torch.equal(read_slice(read_header(file)["w"], ShardSlice(0, 6, 12), torch.float32),
                       torch.ones(6, 8))


def test_a_file_cut_after_its_header_was_read_names_it(tmp_path: Path) -> None:
    file = tmp_path / "w.safetensors"
    save_file({"w": torch.ones(64, 16)}, str(file))
    stored = read_header(file)["w"]
    with open(file, "r+b") as fh:
        fh.truncate(file.stat().st_size - 100)
    with pytest.raises(ValueError, match=r"w.safetensors became shorter while tensor w was read"):
        read_slice(stored, ShardSlice(None), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("where", [ShardSlice(None), ShardSlice(0, 2, 5), ShardSlice(1, 1, 3),
                                   ShardSlice(0, 4, 6, 2)])
def test_a_slice_read_to_the_device_equals_the_host_read(tmp_path, where):
    file = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(6, 4, generator=torch.Generator().manual_seed(0))}, str(file))
    stored = read_header(file)["w"]
    for dtype in (torch.float32, torch.bfloat16):
        on_device = read_slice(stored, where, dtype, "cuda")
        assert on_device.device.type == "cuda"
        assert torch.equal(on_device.cpu(), read_slice(stored, where, dtype))
