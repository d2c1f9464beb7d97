"""Token bytes from tokenizer.json's vocabulary: byte-level (the demo's) and SentencePiece-style."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.token_bytes import token_bytes_table
from hybridmoe.loader.tokenizer import Tokenizer


@pytest.mark.parametrize("text", ["hello world", "naïve café 👋 ok", "\t\n  x", "日本語"])
def test_byte_level_ids_spell_their_text(demo_checkpoint: Path, text):
    tokenizer = Tokenizer.from_dir(demo_checkpoint)
    table = tokenizer.token_bytes(4096)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == text.encode("utf-8")


def test_special_tokens_and_padding_rows(demo_checkpoint: Path):
    table = token_bytes_table(demo_checkpoint / "tokenizer.json", 4100)
    assert table[2] == b"<|im_end|>" and table[4096:] == [b""] * 4


def _write(tmp_path: Path, decoder: dict, vocab: dict[str, int]) -> Path:
    spec = {"model": {"type": "BPE", "vocab": vocab}, "decoder": decoder, "added_tokens": []}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return path


def test_sentencepiece_style(tmp_path: Path):
    decoder = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
        ],
    }
    path = _write(tmp_path, decoder, {"<unk>": 0, "\u2581hi": 1, "<0xE2>": 2, "x": 3})
    assert token_bytes_table(path, 4) == [b"<unk>", b" hi", b"\xe2", b"x"]


def test_an_unknown_decoder_is_refused(tmp_path: Path):
    path = _write(tmp_path, {"type": "WordPiece"}, {"a": 0})
    with pytest.raises(CheckpointError, match="WordPiece"):
        token_bytes_table(path, 1)
