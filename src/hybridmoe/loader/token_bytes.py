"""The exact bytes each token id stands for, read from tokenizer.json's vocabulary.

Decoding one id alone is lossy (a token holding half of a UTF-8 character decodes to U+FFFD), so
logprobs' `bytes` and grammar-constrained decoding read the vocabulary's own spelling instead:
byte-level BPE (GPT-2 / Qwen / OLMoE: each byte written as one printable character) and
SentencePiece-style BPE (Llama / Mixtral: U+2581 for a space, `<0xNN>` byte-fallback tokens).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from hybridmoe.errors import CheckpointError

_SPACE_MARK = "\u2581"  # SentencePiece's visible space
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE (GPT-2's bytes_to_unicode): printable Latin-1 bytes
    stand for themselves; the other 68 bytes map to U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


def token_bytes_table(tokenizer_json: Path, vocab_size: int) -> list[bytes]:
    """bytes of every id in [0, vocab_size); ids the tokenizer does not define (embedding rows
    beyond its vocabulary) are b"". Special/added tokens are their content in UTF-8.
    Raises CheckpointError when the tokenizer's decoder is of a kind this module does not read."""
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    spell = _speller(spec.get("decoder"), tokenizer_json)
    added = {token["id"]: token["content"] for token in spec.get("added_tokens", [])}
    table = [b""] * vocab_size
    for text, token_id in spec.get("model", {}).get("vocab", {}).items():
        if token_id < vocab_size and token_id not in added:
            table[token_id] = spell(text, tokenizer_json)
    for token_id, content in added.items():
        if token_id < vocab_size:
            table[token_id] = content.encode("utf-8")
    return table


def _speller(decoder: Any, where: Path):
    kinds = _decoder_kinds(decoder)
    if "ByteLevel" in kinds:
        return _byte_level_bytes
    if "Replace" in kinds or "Metaspace" in kinds:
        return _sentencepiece_bytes
    raise CheckpointError(
        f"{where} 'decoder': token bytes are read for ByteLevel and SentencePiece-style "
        f"(Replace/Metaspace + ByteFallback) decoders, got {sorted(kinds) or 'none'}"
    )


def _decoder_kinds(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    if decoder.get("type") == "Sequence":
        return {kind for d in decoder.get("decoders", []) for kind in _decoder_kinds(d)}
    return {str(decoder.get("type"))}


def _byte_level_bytes(text: str, where: Path) -> bytes:
    alphabet = _byte_level_alphabet()
    try:
        return bytes(alphabet[c] for c in text)
    except KeyError as e:
        raise CheckpointError(f"{where}: byte-level token {text!r} has a character {e}") from e


def _sentencepiece_bytes(text: str, where: Path) -> bytes:
    byte = _BYTE_TOKEN.fullmatch(text)
    if byte:
        return bytes([int(byte.group(1), 16)])
    return text.replace(_SPACE_MARK, " ").encode("utf-8")
