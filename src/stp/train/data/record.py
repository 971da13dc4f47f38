"""What a run's data was, recorded in its run directory (`DATA_FILE`, written before
the first step) so that `--resume` refuses other data unless `--data-changed-ok`.

The batches are a pure function of (seed, step) and the checkpoint's step is the
consumed position, so the same data resumes with the next batch on any mesh;
other data would silently train on other batches."""

from __future__ import annotations

import json
from pathlib import Path

from stp.files import read_json, write_text_atomic

__all__ = ["DATA_FILE", "check_data_unchanged", "write_data_record"]

DATA_FILE = "data.json"


def write_data_record(out: Path, fingerprint: str, data: str | None) -> None:
    write_text_atomic(out / DATA_FILE, json.dumps(
        {"data": data, "fingerprint": fingerprint}, indent=1) + "\n")


def check_data_unchanged(run_dir: Path, fingerprint: str, data: str | None,
                         changed_ok: bool) -> None:
    """ValueError (one line) when the run in `run_dir` recorded other data than
    `fingerprint`, unless `changed_ok`; nothing to check when it recorded none."""
    path = run_dir / DATA_FILE
    if changed_ok or not path.is_file():
        return
    doc = read_json(path, 1 << 20)
    saved = doc.get("fingerprint") if isinstance(doc, dict) else None
    if saved == fingerprint:
        return
    was = doc.get("data") if isinstance(doc, dict) else None
    raise ValueError(f"--data {data or '(default)'} is not the data the run being resumed "
                     f"trained on ({was or '(default)'}, recorded in {path}): its batches "
                     "would differ; give the same data, or --data-changed-ok to go on with "
                     "this data")
