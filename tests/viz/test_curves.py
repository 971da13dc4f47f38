"""`stp draw --metrics`: training curves from runs' metrics.jsonl, and the files
it refuses (a metrics file comes from elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stp.cli.main import main
from stp.viz import curves
from stp.viz.curves import curves_scene, load_metrics
from stp.viz.scene import Poly


def _run_dir(root: Path, name: str, steps: int, eval_every: int = 0) -> Path:
    d = root / name
    d.mkdir()
    with (d / "metrics.jsonl").open("w") as f:
        for s in range(1, steps + 1):
            row = {"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0 / s,
                   "tokens_per_s": 100.0 * s, "mfu": None}
            if eval_every and s % eval_every == 0:
                row["eval_loss"] = 6.0 / s
            f.write(json.dumps(row) + "\n")
    return d


def test_two_runs_overlaid_one_line_per_run_and_figure(tmp_path: Path) -> None:
    a = load_metrics(_run_dir(tmp_path, "a", 6, eval_every=2))
    b = load_metrics(_run_dir(tmp_path, "b", 4))
    assert a.series["loss"] == [(s, 5.0 / s) for s in range(1, 7)]
    assert a.series["eval_loss"] == [(2, 3.0), (4, 1.5), (6, 1.0)]
    assert "eval_loss" not in b.series and "mfu" not in a.series  # null: not drawn
    scene = curves_scene([a, b])
    lines = [it for it in scene.items if isinstance(it, Poly)]
    assert len(lines) == 2 * 4  # two runs x (loss, lr, grad norm, tokens/s)
    texts = {it.text for it in scene.items if hasattr(it, "text")}
    assert {"a", "b", "learning rate", "gradient norm", "tokens / s"} <= texts


def test_draw_metrics_writes_svg(tmp_path: Path) -> None:
    a, b = _run_dir(tmp_path, "a", 5), _run_dir(tmp_path, "b", 5)
    out = tmp_path / "curve.svg"
    assert main(["draw", "--metrics", str(a), str(b), "--out", str(out)]) == 0
    svg = out.read_text()
    assert svg.startswith("<svg") or "<svg" in svg[:200]
    assert svg.count("<polyline") == 8


@pytest.mark.parametrize("extra, message", [
    (["--schedule", "1f1b"], "--metrics draws a recorded run; drop --schedule"),
    (["--trace", "t.json"], "--metrics draws training curves; drop --trace"),
    ([], "--metrics needs --out FILE.svg or FILE.png"),
])
def test_draw_metrics_refuses_schedule_flags(tmp_path: Path, capsys: pytest.CaptureFixture,
                                            extra: list[str], message: str) -> None:
    a = _run_dir(tmp_path, "a", 3)
    out = [] if not extra or extra[0] != "--schedule" and extra[0] != "--trace" else \
        ["--out", str(tmp_path / "c.svg")]
    assert main(["draw", "--metrics", str(a), *out, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_hostile_metrics_files_are_refused_in_one_line(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    d = _run_dir(tmp_path, "a", 3)
    with (d / "metrics.jsonl").open("a") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 4 is not a step object"):
        load_metrics(d)
    (d / "metrics.jsonl").write_text('{"step": "1", "loss": 2}\n')
    with pytest.raises(ValueError, match="line 1 is not a step object"):
        load_metrics(d)
    with pytest.raises(ValueError, match="no metrics.jsonl there"):
        load_metrics(tmp_path / "missing")
    d2 = _run_dir(tmp_path, "b", 3)
    monkeypatch.setattr(curves, "MAX_METRICS_BYTES", 10)
    with pytest.raises(ValueError, match="more than a metrics file holds"):
        load_metrics(d2)


def test_a_last_line_cut_short_is_passed_over(tmp_path: Path) -> None:
    d = _run_dir(tmp_path, "a", 3)
    with (d / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')
    assert [s for s, _ in load_metrics(d).series["loss"]] == [1, 2, 3]
