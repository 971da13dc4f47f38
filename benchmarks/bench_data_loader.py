"""Does the data loader stall a step? `stp train`'s step time (its `--json` step_s,
which includes fetching the step's batch) on a Megatron dataset prepared from
JSONL, three ways, in one process, rounds alternating:

  prebuilt   every batch built before the first step (a list lookup per step);
  loader     stp's loader: batches built ahead on the background thread;
  inline     the same loader with the thread off (each batch built in the step).

    PYTHONPATH=src python benchmarks/bench_data_loader.py --rounds 3 \\
        --out benchmarks/results/data_loader.json

The data is tokenised once (`stp data prepare`, timed too: what a step would pay
if it tokenised its own text).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "models"))
from _hf import corpus_text, save_tokenizer  # noqa: E402

import stp.train.families.decoder as decoder  # noqa: E402
import stp.train.run.loop as loop  # noqa: E402
from stp.cli.main import main  # noqa: E402

SHAPE = ["--pp", "1", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "256",
         "--microbatch-size", "4", "-m", "2", "--timeout", "600"]
WAITS: list[float] = []
"""Seconds each step waited for its batch (the fetch inside the timed step)."""


def _timed(make: Any) -> Any:
    class Timed:
        def __init__(self, *a: Any) -> None:
            self.inner = make(*a)

        def batch(self, step: int) -> Any:
            start = time.perf_counter()
            got = self.inner.batch(step)
            WAITS.append(time.perf_counter() - start)
            return got

        def close(self) -> None:
            self.inner.close()

    return Timed


class _Prebuilt:
    def __init__(self, batches: Any, steps: int) -> None:
        self.rows = [batches.batch(k) for k in range(steps)]

    def batch(self, step: int) -> Any:
        return self.rows[step]


class _NoThread:
    def __init__(self, batches: Any, first: int, stop: int) -> None:
        self.batches = batches

    def batch(self, step: int) -> Any:
        return self.batches.batch(step)

    def close(self) -> None:
        pass


def _run(way: str, flags: list[str], steps: int, capsys_out: Path) -> list[tuple[float, float]]:
    real_batches, real_prefetch = decoder.DecoderJob.batches, loop.Prefetched
    if way == "prebuilt":
        decoder.DecoderJob.batches = lambda self, run: _Prebuilt(real_batches(self, run), steps)
    loop.Prefetched = _timed(_NoThread if way in ("inline", "prebuilt") else real_prefetch)
    WAITS.clear()
    try:
        out = capsys_out / f"{way}-{time.monotonic_ns()}.jsonl"
        with open(out, "w") as f:
            old, sys.stdout = sys.stdout, f
            try:
                assert main(["train", *flags, "--steps", str(steps), "--json"]) == 0
            finally:
                sys.stdout = old
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        steps_s = [r["step_s"] for r in rows if "step_s" in r]
        return list(zip(steps_s[1:], WAITS[1:], strict=True))  # the first step warms up
    finally:
        decoder.DecoderJob.batches, loop.Prefetched = real_batches, real_prefetch


def _prepared_tokens(tmp: Path) -> int:
    return int(json.loads((tmp / "docs.hist.json").read_text())["tokens"])


def main_(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--words", type=int, default=400_000, help="words of JSONL text")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="stp-bench-data-"))
    save_tokenizer(tmp, corpus_text(), vocab=256)
    docs = [s.strip() for s in corpus_text(args.words, seed=1).split(".") if s.strip()]
    (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    start = time.perf_counter()
    assert main(["data", "prepare", str(tmp / "docs.jsonl"), "--tokenizer", str(tmp),
                 "--out", str(tmp / "docs")]) == 0
    prepare_s = time.perf_counter() - start
    ways = ("prebuilt", "loader", "inline")
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in ways:
            flags = [*SHAPE, "--data", str(tmp / "docs"), "--tokenizer", str(tmp),
                     "--out", str(tmp / f"out-{way}-{r}")]
            times[way] += _run(way, flags, args.steps, tmp)
    med = {w: statistics.median(s for s, _ in t) for w, t in times.items()}
    wait = {w: statistics.median(x for _, x in t) for w, t in times.items()}
    tokens = int(SHAPE[SHAPE.index("--seq-len") + 1]) * 8
    result = {"prepare_s": prepare_s, "documents": len(docs), "tokens_per_step": tokens,
              "tokenise_s_per_step": prepare_s * tokens / _prepared_tokens(tmp),
              "step_s_median": med, "batch_wait_s_median": wait,
              "wait_share_of_step": {w: wait[w] / med[w] for w in ways},
              "steps_per_way": {w: len(t) for w, t in times.items()},
              "loader_vs_prebuilt": med["loader"] / med["prebuilt"] - 1,
              "inline_vs_prebuilt": med["inline"] / med["prebuilt"] - 1,
              "flags": SHAPE}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
