"""`--images` / `--eval-images` folders from elsewhere: a captions.txt naming a file
outside its folder (`..`, an absolute path, a link leading out) is refused before it is
opened, and a corrupt, truncated or decompression-bomb image is refused before any
worker starts, each in one line naming the file (exit 2), never a traceback."""

from __future__ import annotations

import os
import struct
import zlib

import pytest
from PIL import Image

from stp.cli.main import main
from stp.train.data.images import check_folder

SHAPE = ["--arch", "mllm", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "12",
         "--vision-layers", "2", "--image-size", "8", "--patch", "2", "--vision-hidden", "8",
         "--microbatch-size", "1", "-m", "4", "--dtype", "float64", "--steps", "2"]


def _folder(path, names: list[str]):
    """A folder with one good 8 x 8 PNG (`ok.png`) and a captions.txt listing `names`."""
    path.mkdir()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(path / "ok.png")
    (path / "captions.txt").write_text("".join(f"{n}\tcap\n" for n in names), encoding="utf-8")
    return path


def _outside(tmp_path):
    """An image outside the folder, a real PNG (so only the escape can refuse it)."""
    Image.new("RGB", (8, 8), (0, 0, 200)).save(tmp_path / "secret.png")
    return tmp_path / "secret.png"


@pytest.mark.parametrize("name", ["../secret.png", "{abs}", "sub/../../secret.png", "link.png"])
def test_a_name_resolving_outside_the_folder_is_refused(tmp_path, name):
    """Guards against opening whatever a captions.txt names (`/etc/passwd` was opened)."""
    secret = _outside(tmp_path)
    folder = _folder(tmp_path / "imgs", ["ok.png", name.format(abs=secret)])
    (folder / "sub").mkdir()
    os.symlink(secret, folder / "link.png")
    with pytest.raises(ValueError, match="resolves outside") as e:
        check_folder(str(folder), "--images")
    assert "captions.txt:2" in str(e.value)


def test_a_link_inside_the_folder_is_accepted(tmp_path):
    folder = _folder(tmp_path / "imgs", ["ok.png", "alias.png"])
    os.symlink(folder / "ok.png", folder / "alias.png")
    check_folder(str(folder), "--images")


def _truncated(folder):
    whole = (folder / "ok.png").read_bytes()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(folder / "big.png")
    data = (folder / "big.png").read_bytes()
    (folder / "bad.png").write_bytes(data[: len(data) // 2])
    return whole


def _chunk(kind: bytes, body: bytes) -> bytes:
    return (struct.pack(">I", len(body)) + kind + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))


def _bomb(folder):
    """A PNG whose header claims 40,000 x 40,000 pixels (past Pillow's bomb limit) over a
    few bytes of compressed zeros: decoding it would take gigabytes."""
    header = struct.pack(">IIBBBBB", 40_000, 40_000, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\x00" * 4096)
    (folder / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
                                     + _chunk(b"IDAT", data) + _chunk(b"IEND", b""))


def _garbage(folder):
    (folder / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)


@pytest.mark.parametrize("damage", [_truncated, _bomb, _garbage],
                         ids=["truncated", "decompression-bomb", "garbage"])
def test_a_damaged_image_is_refused_before_any_worker(tmp_path, damage, capsys):
    """Guards against checking headers only: a truncated file's header opens, and the
    run then died in a worker with a 34-65 line traceback."""
    folder = _folder(tmp_path / "imgs", ["ok.png", "bad.png"])
    damage(folder)
    code = main(["train", *SHAPE, "--images", str(folder), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "bad.png" in err and "--images" in err, err


def test_eval_images_escape_is_refused_in_one_line(tmp_path, capsys):
    secret = _outside(tmp_path)
    train = _folder(tmp_path / "train", ["ok.png"])
    held = _folder(tmp_path / "held", [str(secret)])
    code = main(["train", *SHAPE, "--images", str(train), "--eval-every", "1",
                 "--eval-images", str(held), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "resolves outside" in err and "captions.txt" in err, err
