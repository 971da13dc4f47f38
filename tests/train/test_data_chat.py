"""Chat data (stp.train.data.chat): a fixed conversation rendered with a Qwen2-style
chat template from tokenizer_config.json; the loss only on assistant turns, found
by rendering prefix by prefix. The expectation is counted by hand, token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from stp.train.data.chat import IGNORE, ChatTemplate
from stp.train.data.load import DataOptions, open_data
from stp.train.data.tokens import Tokenizer as RunTokenizer

pytest.importorskip("transformers")

# Qwen2's layout: a default system turn, <|im_start|>ROLE\nCONTENT<|im_end|>\n per
# message, and `<|im_start|>assistant\n` as the generation prompt
TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = ["<pad>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "You", "are",
         "a", "helpful", ".", "hello", "there", "hi", "friend", "how", "you", "fine", "thanks"]
CONVERSATION = [{"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "hi friend"},
                {"role": "user", "content": "how are you"},
                {"role": "assistant", "content": "fine thanks"}]
# the render, token by token:
#  0 <|im_start|> 1 system 2 You 3 are 4 a 5 helpful 6 assistant 7 . 8 <|im_end|>
#  9 <|im_start|> 10 user 11 hello 12 there 13 <|im_end|>
# 14 <|im_start|> 15 assistant 16 hi 17 friend 18 <|im_end|>
# 19 <|im_start|> 20 user 21 how 22 are 23 you 24 <|im_end|>
# 25 <|im_start|> 26 assistant 27 fine 28 thanks 29 <|im_end|>
TRAINED = [16, 17, 18, 27, 28, 29]  # the assistants' words and <|im_end|>, not the header


@pytest.fixture
def chat_tokenizer(tmp_path) -> Path:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<pad>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<pad>"}))
    return tmp_path / "tokenizer.json"


def test_the_loss_falls_on_the_assistant_turns_counted_by_hand(chat_tokenizer):
    ids, labels = ChatTemplate(chat_tokenizer).render(CONVERSATION, "conversation")
    assert len(ids) == 30
    assert [WORDS[i] for i in ids[14:19]] == ["<|im_start|>", "assistant", "hi", "friend",
                                              "<|im_end|>"]
    assert [k for k, label in enumerate(labels) if label != IGNORE] == TRAINED
    assert all(labels[k] == ids[k] for k in TRAINED)


def _write(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def test_batches_shift_the_labels_pad_short_rows_and_cut_long_ones(tmp_path, chat_tokenizer):
    tok = RunTokenizer(chat_tokenizer, WORDS.index("<|im_end|>"))
    data = _write(tmp_path / "chat.jsonl", [CONVERSATION])
    opened = open_data(DataOptions(str(data)), tok, 32, 40, 1, 0)
    tokens, targets = opened.batches.batch(0)
    assert tokens.shape == targets.shape == (1, 40)
    assert [t for t in range(40) if targets[0, t] != IGNORE] == [k - 1 for k in TRAINED]
    assert tokens[0, 30:].tolist() == [0] * 10  # padded with <pad>, no loss there
    assert "chat" in opened.line() and "0 cut at --seq-len" in opened.line()
    cut = open_data(DataOptions(str(data)), tok, 32, 20, 1, 0)
    tokens, targets = cut.batches.batch(0)
    assert [t for t in range(20) if targets[0, t] != IGNORE] == [15, 16, 17]
    assert "1 documents" in cut.line() and "1 cut at --seq-len" in cut.line()


def test_a_tokenizer_without_a_chat_template_and_a_bad_message_are_one_line(tmp_path,
                                                                         chat_tokenizer):
    (chat_tokenizer.parent / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplate(chat_tokenizer)
    (chat_tokenizer.parent / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE}))
    tok = RunTokenizer(chat_tokenizer, 2)
    bad = _write(tmp_path / "bad.jsonl", [[{"role": "wizard", "content": "hi"}]])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 0: a message is not"):
        open_data(DataOptions(str(bad)), tok, 32, 40, 1, 0)
