"""Token packing when the stream does not divide into sequences (stp.train.data.tokens).

What the module promises: the documents, each followed by EOS, form one stream
cut into sequences of seq_len + 1 tokens, the last partial one dropped; batch t
takes rows [t B, (t + 1) B) of an endless list made of one seeded permutation of
the sequences per epoch, so a batch may straddle two epochs; (tokens, targets)
are a row without its last token and without its first.

The references are hand counts: a stream whose token at position p is p (the
cache's int32 format written directly), so every token of a batch names its own
position; and two small documents cut by a word-level tokenizer built here
(nothing downloaded), the expected stream spelled out word by word.
"""

from __future__ import annotations

from array import array
from collections import Counter
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from stp.train.data.tokens import TokenBatches, Tokenizer, TokenStream, make_batches

SEQ_LEN = 6
SPAN = SEQ_LEN + 1
FULL = 11  # sequences
TAIL = 5  # tokens after the last whole sequence: 82 = 11 x 7 + 5
BATCH = 4  # does not divide 11: steps 2 and 5 straddle an epoch boundary


def _positions(tmp_path: Path, n: int) -> TokenStream:
    path = tmp_path / "positions.bin"
    path.write_bytes(array("i", range(n)).tobytes())
    return TokenStream(path)


def test_the_partial_last_sequence_is_dropped_and_each_epoch_is_every_sequence_once(
    tmp_path: Path,
) -> None:
    """Guards against a mis-packed tail: the partial sequence carried as a row
    (rows counted by ceiling division), sequences counted as size // seq_len (the
    target's extra token forgotten), a stride other than seq_len + 1 or an epoch
    boundary mishandled inside a batch. 82 tokens at seq_len 6: 11 sequences of 7,
    positions 77..81 in no batch, and over the six steps that read 24 rows, rows
    0..10 (epoch 0) and 11..21 (epoch 1) each read positions 0..76 exactly once."""
    b = TokenBatches(_positions(tmp_path, FULL * SPAN + TAIL), SEQ_LEN, BATCH, seed=3)
    assert b.sequences == FULL
    windows: list[list[int]] = []
    for step in range(6):
        tokens, targets = b.batch(step)
        assert tokens.shape == targets.shape == (BATCH, SEQ_LEN)
        assert tokens.dtype == targets.dtype == torch.int64
        assert torch.equal(targets, tokens + 1)  # the next token of the stream
        windows += [[*row.tolist(), int(last)] for row, last in zip(tokens, targets[:, -1],
                                                                    strict=True)]
    for w in windows:  # a whole packed sequence: SPAN consecutive positions from k SPAN
        assert w == list(range(w[0], w[0] + SPAN)) and w[0] % SPAN == 0, w
    whole = set(range(FULL * SPAN))
    for epoch in (windows[:FULL], windows[FULL:2 * FULL]):
        seen = Counter(p for w in epoch for p in w)
        assert set(seen) == whole and set(seen.values()) == {1}
    assert not {p for w in windows for p in w} & set(range(FULL * SPAN, FULL * SPAN + TAIL))
    # a new permutation each epoch (seeded, so this is a fixed fact of seed 3)
    assert [w[0] for w in windows[:FULL]] != [w[0] for w in windows[FULL:2 * FULL]]
    # a pure function of (seed, step): read backwards by a fresh reader, the same rows
    again = TokenBatches(_positions(tmp_path, FULL * SPAN + TAIL), SEQ_LEN, BATCH, seed=3)
    for step in reversed(range(6)):
        tokens, targets = again.batch(step)
        got = [[*row.tolist(), int(last)] for row, last in zip(tokens, targets[:, -1],
                                                               strict=True)]
        assert got == windows[step * BATCH:(step + 1) * BATCH]


def test_a_stream_one_token_short_of_a_sequence_more_keeps_the_count(tmp_path: Path) -> None:
    """The boundary itself: SPAN k - 1 tokens make k - 1 sequences, SPAN k and
    SPAN (k + 1) - 1 make k (a count off by one at the edge reads past the end, or
    drops a whole sequence); an epoch's batch starts at each of them once."""
    for n, want in ((FULL * SPAN - 1, FULL - 1), (FULL * SPAN, FULL),
                    (FULL * SPAN + SPAN - 1, FULL)):
        b = TokenBatches(_positions(tmp_path, n), SEQ_LEN, want, seed=0)
        assert b.sequences == want, n
        tokens, targets = b.batch(0)  # exactly one epoch
        assert sorted(tokens[:, 0].tolist()) == [SPAN * k for k in range(want)], n
        assert int(targets.max()) == want * SPAN - 1, n


def _word_tokenizer(path: Path, words: list[str]) -> int:
    """A word-level tokenizer.json over `words` (ids 2.. in order; 0 unknown, 1 EOS);
    returns the EOS id."""
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return 1


def test_documents_packed_across_their_boundary_with_the_tail_dropped(tmp_path: Path) -> None:
    """The whole path (stp.train.data.tokens.make_batches: tokenise, join with EOS, pack):
    documents of 66 and 69 distinct words are 67 + 70 = 137 tokens; at seq_len 9,
    13 sequences of 10 cover stream positions 0..129 (sequence 6 straddles the two
    documents: A's last 6 words, its EOS, B's first 3), and positions 130..136 (B's
    last 6 words and the closing EOS) are in no batch. Guards against the same tail
    bugs as above, and against documents packed without the EOS between them."""
    words = [f"word{i:04d}" for i in range(135)]
    data = tmp_path / "docs"
    data.mkdir()
    (data / "a.txt").write_text(" ".join(words[:66]) + "\n")
    (data / "b.txt").write_text(" ".join(words[66:]) + "\n")
    eos = _word_tokenizer(tmp_path / "tokenizer.json", words)
    stream = [*range(2, 68), eos, *range(68, 137), eos]  # word i has id i + 2
    assert len(stream) == 137
    batches = make_batches(str(data), Tokenizer(tmp_path / "tokenizer.json", eos), 9, 13, 0)
    assert isinstance(batches, TokenBatches) and batches.sequences == 13
    tokens, targets = batches.batch(0)  # one whole epoch
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    rows = [[*r.tolist(), int(t)] for r, t in zip(tokens, targets[:, -1], strict=True)]
    want = [stream[10 * k:10 * k + 10] for k in range(13)]
    assert sorted(rows) == sorted(want)
    assert want[6] == [*range(62, 68), eos, 68, 69, 70]  # across the boundary
    dropped = set(range(131, 137))  # B's last 6 words' ids
    assert stream[130:] == [*sorted(dropped), eos]
    assert not dropped & {t for r in rows for t in r}
