"""Chat data for fine-tuning: JSONL rows `{"messages": [{"role", "content"}, ...]}`
rendered with the tokenizer's chat template (`chat_template` of the
tokenizer_config.json beside tokenizer.json, through transformers, an optional
extra), the loss on assistant turns only.

Llama 3's and Qwen2's templates mark no generation spans, so each assistant turn's
tokens are found by rendering the conversation prefix by prefix: the turn spans
from the end of the messages before it rendered with the generation prompt (so
the `assistant` header is not trained) to the end of the messages up to it. A
template whose prefix renderings are not prefixes of the whole is refused.

Each conversation is one row of seq_len + 1 tokens: a shorter one padded (pad id,
no loss), a longer one cut at the end and counted. Rows are drawn as packed
sequences are (a seeded permutation per epoch): batches are a pure function of
(seed, step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from stp.files import read_json_object
from stp.train.data.source import DataSummary

__all__ = ["IGNORE", "ChatBatches", "ChatTemplate", "open_chat"]

IGNORE = -100
_EPOCH_SEED = 7_919
_ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """A tokenizer.json and its tokenizer_config.json's chat template."""

    def __init__(self, tokenizer_json: Path) -> None:
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise ValueError("chat data needs transformers: pip install 'stp[data]'") from None
        side = tokenizer_json.parent / "tokenizer_config.json"
        config = read_json_object(side, 4 << 20) if side.is_file() else {}
        template = config.get("chat_template")
        if not isinstance(template, str):
            raise ValueError(f"{side}: no chat_template (a string) to render chat data with")
        self.tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        self.tok.chat_template = template
        named = config.get("pad_token")
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else \
            self.tok.convert_tokens_to_ids(named) if isinstance(named, str) else None
        self.pad = pad if isinstance(pad, int) and pad >= 0 else 0

    def _ids(self, messages: list[dict[str, str]], prompt: bool = False) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=prompt)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
        """(token ids, labels): labels are the ids on assistant turns, IGNORE elsewhere."""
        ids = self._ids(messages)
        labels = [IGNORE] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start, end = len(self._ids(messages[:i], prompt=True)), self._ids(messages[:i + 1])
            if ids[:len(end)] != end or not start <= len(end):
                raise ValueError(f"{where}: the chat template does not render a conversation's "
                                 "beginning as the beginning of the whole; stp cannot find "
                                 "its assistant turns")
            labels[start:len(end)] = ids[start:len(end)]
        return ids, labels


def _messages(row: Any, where: str) -> list[dict[str, str]]:
    msgs = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: no 'messages' list")
    for m in msgs:
        if not (isinstance(m, dict) and m.get("role") in _ROLES
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: a message is not {{'role': {'|'.join(_ROLES)}, "
                             "'content': text}")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


@dataclass
class ChatBatches:
    """Rows of rendered conversations; batch t fixed by (seed, t)."""

    rows: list[tuple[list[int], list[int]]]
    """(ids, labels) of each conversation, seq_len + 1 long (padded or cut)."""
    seq_len: int
    batch_size: int
    seed: int = 0
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def _row(self, i: int) -> int:
        epoch, pos = divmod(i, len(self.rows))
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * _EPOCH_SEED)
            self._perms = {epoch: torch.randperm(len(self.rows), generator=gen)}
        return int(self._perms[epoch][pos])

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) [batch_size, seq_len]; a target is IGNORE off assistant turns."""
        first = step * self.batch_size
        picked = [self.rows[self._row(i)] for i in range(first, first + self.batch_size)]
        ids = torch.tensor([p[0] for p in picked], dtype=torch.int64)
        labels = torch.tensor([p[1] for p in picked], dtype=torch.int64)
        return ids[:, :-1].contiguous(), labels[:, 1:].contiguous()


def open_chat(path: str | os.PathLike[str], tokenizer_json: Path, seq_len: int,
              batch_size: int, seed: int) -> tuple[ChatBatches, DataSummary, int]:
    """(batches, summary, conversations cut at seq_len + 1 tokens) of a chat JSONL."""
    from stp.train.data.records import iter_column

    template, span = ChatTemplate(tokenizer_json), seq_len + 1
    rows, cut, tokens = [], 0, 0
    for n, row in enumerate(iter_column(path, "jsonl", "messages")):
        ids, labels = template.render(_messages({"messages": row}, f"{path}: row {n}"),
                                      f"{path}: row {n}")
        cut += len(ids) > span
        ids, labels = ids[:span], labels[:span]
        tokens += len(ids)
        pad = span - len(ids)
        rows.append((ids + [template.pad] * pad, labels + [IGNORE] * pad))
    if not rows:
        raise ValueError(f"{path}: no conversations")
    summary = DataSummary("chat", str(path), len(rows), tokens, 0)
    return ChatBatches(rows, seq_len, batch_size, seed), summary, cut
