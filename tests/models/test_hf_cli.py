"""`stp train --init-from DIR`: the same losses on one process and on meshes as
transformers trained alike, --save-hf back to transformers, bad input refused
before any worker starts.

Qwen2 (q/k/v bias; tied embedding and head, exchanged between pipeline ranks
under 1f1b; one kv head, replicated under tp=2), text tokenised with the
checkpoint's tokenizer.json. Three steps of AdamW (stp's defaults: lr 3e-3,
betas 0.9 / 0.95, no weight decay), float64: every step's loss on one process,
pp2 x tp2 (stp) and pp2 x dp2 (1f1b) equals transformers' (float64 RMSNorm,
rotary and softmax) on the same batches within 1e-9; the model saved after
training loads in transformers with no missing or unexpected keys and gives
the logits of transformers' own trained model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import _hf
import pytest
import torch

from stp.cli.main import main
from stp.models import hf
from stp.train.data.tokens import TokenBatches, TokenStream, eos_id, tokenize

COMMON = ["--data", "{data}", "--steps", "3", "--dtype", "float64", "--seq-len", "16",
          "--json", "--timeout", "60"]
RUNS = {
    "single": ["--pp", "1", "--schedule", "1f1b", "-m", "4", "--microbatch-size", "2"],
    "pp2-tp2-stp": ["--pp", "2", "--tp", "2", "--schedule", "stp", "-m", "4",
                    "--microbatch-size", "2", "--save-hf", "{saved}"],
    "pp2-dp2-1f1b": ["--pp", "2", "--dp", "2", "--schedule", "1f1b", "-m", "4",
                     "--microbatch-size", "1"],
}
GLOBAL_BATCH, SEQ = 8, 16


def _stp_train(args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "stp.cli.main", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _transformers_losses(ckpt: Path, data: Path, steps: int) -> tuple[list[float], object]:
    """transformers (float64 everywhere) trained with torch's AdamW on stp's batches."""
    from transformers import AutoModelForCausalLM

    model = _hf.float64_everywhere(AutoModelForCausalLM.from_pretrained(ckpt,
                                                                        dtype=torch.float64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    tok = ckpt / "tokenizer.json"
    eos = eos_id(tok, json.loads((ckpt / "config.json").read_text()))
    batches = TokenBatches(TokenStream(tokenize(str(data), tok, eos)), SEQ, GLOBAL_BATCH, 0)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = _hf.hf_loss(model, *batches.batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.slow
def test_init_from_trains_alike_on_every_mesh_and_saves_back(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    ckpt, data, saved = checkpoints["qwen2"], tmp_path / "data.txt", tmp_path / "saved"
    data.write_text(_hf.corpus_text(3000, seed=1))
    losses, cache = {}, None
    for name, mesh in RUNS.items():
        args = [a.format(data=data, saved=saved) for a in ["--init-from", str(ckpt), *COMMON,
                                                           *mesh, "--out", str(tmp_path / name)]]
        out = _stp_train(args)
        assert out.returncode == 0, out.stderr
        losses[name] = [r["loss"] for r in map(json.loads, out.stdout.splitlines())
                        if "loss" in r]
        caches = sorted((tmp_path / ".data.txt.stp-tokens").glob("*.bin"))
        assert len(caches) == 1  # tokenised once, next to the data, then read
        stamp = caches[0].stat().st_mtime_ns
        assert cache is None or cache == stamp
        cache = stamp
    theirs, trained = _transformers_losses(ckpt, data, 3)
    for name, got in losses.items():
        assert len(got) == 3
        assert max(abs(a - b) / abs(b) for a, b in zip(got, theirs, strict=True)) < 1e-9, (
            name, got, theirs)

    loaded, info = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64,
                                                        output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert (saved / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = trained(input_ids=tokens).logits
        got = _hf.float64_everywhere(loaded)(input_ids=tokens).logits
        mine = hf.load(saved, dtype=torch.float64).logits(tokens)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-9
    assert float((mine - got).abs().max() / got.abs().max()) < 1e-12


def _copy_with(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    raw = {**json.loads((src / "config.json").read_text()), **changes}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "does not exist"),
        ("architecture", "model_type='gpt2' is not supported"),
        ("shapes", "has shape [64, 32], but config.json implies [80, 32]"),
        ("layers", "--layers 2 contradicts the checkpoint"),
        ("seq-len", "--seq-len 128 exceeds the checkpoint's max_position_embeddings=64"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_worker(
    case: str, needle: str, checkpoints: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    src = checkpoints["llama"]
    path = {"missing": tmp_path / "nowhere",
            "architecture": tmp_path / "arch", "shapes": tmp_path / "shapes"}.get(case, src)
    if case == "architecture":
        _copy_with(src, path, model_type="gpt2")
    elif case == "shapes":
        _copy_with(src, path, intermediate_size=80)
    extra = {"layers": ["--layers", "2"], "seq-len": ["--seq-len", "128"]}.get(case, [])
    out = tmp_path / "out"
    code = main(["train", "--init-from", str(path), "--pp", "2", "--steps", "1", *extra,
                 "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and needle in err, err
    if case != "layers" and case != "seq-len":
        assert str(path) in err
    assert not out.exists()  # refused before anything ran or was written
