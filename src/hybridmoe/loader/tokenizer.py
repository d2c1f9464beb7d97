"""A checkpoint's tokenizer: ids from `tokenizers`, special ids from the HF config files, chat
templates rendered as `transformers` renders them, and streaming decode."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.chat_template import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG_FILE,
    ChatTemplate,
    load_chat_template,
    special_token_text,
)
from hybridmoe.loader.files import read_json_object
from hybridmoe.loader.token_bytes import token_bytes_table

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
REPLACEMENT_CHAR = "\ufffd"  # what a decoder prints for bytes that are not (yet) whole UTF-8


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """Text <-> token ids for one checkpoint directory; build it with `Tokenizer.from_dir`.

    `encode` gives the ids `transformers.AutoTokenizer(...).encode` gives for the same directory.
    `eos_token_ids` is the union of every file's end-of-sequence ids and may be empty.
    `bos_token_id` and `pad_token_id` come from tokenizer_config.json only, as transformers'
    tokenizer reports them; None when unset.
    """

    directory: Path
    backend: tokenizers.Tokenizer = field(repr=False)  # its repr is the whole vocabulary
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template: ChatTemplate | None = field(repr=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (required) and tokenizer_config.json, generation_config.json,
        config.json and chat_template.jinja (optional). Raises CheckpointError naming the file
        that is missing, corrupt or inconsistent."""
        directory = Path(path)
        backend = _load_backend(directory / TOKENIZER_FILE)
        tokenizer_config = read_json_object(directory / TOKENIZER_CONFIG_FILE, required=False)
        token_id = _token_id_lookup(backend, directory / TOKENIZER_CONFIG_FILE)
        return cls(
            directory=directory,
            backend=backend,
            eos_token_ids=_eos_token_ids(directory, tokenizer_config, token_id),
            bos_token_id=token_id(tokenizer_config, "bos_token"),
            pad_token_id=token_id(tokenizer_config, "pad_token"),
            chat_template=load_chat_template(directory, tokenizer_config),
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included. The model's embedding
        may have more rows (padding)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters of text one token stands for: the longest token string in the
        vocabulary, added tokens included (a byte-level token's string has one character per
        byte it covers, so this bounds characters too). Computed once."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (what skip_special_tokens drops)."""
        added = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    def token_bytes(self, vocab_size: int) -> tuple[bytes, ...]:
        """The exact bytes of every id in [0, vocab_size) (loader/token_bytes.py)."""
        return _token_bytes(self.directory / TOKENIZER_FILE, vocab_size)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, what tokenizer.json's post-processor
        adds (e.g. a BOS) is included."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; bytes that do not form whole UTF-8 characters decode to U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict | None = None,
    ) -> str:
        """The prompt text for `messages` (and `tools`, and further template `variables`), as
        transformers' `apply_chat_template(tokenize=False, **variables)` renders it. Raises
        CheckpointError if the checkpoint has no chat template or it does not compile, and
        ValueError if the template rejects the messages."""
        if self.chat_template is None and self.directory.is_file():  # a GGUF
            raise CheckpointError(
                f"{self.directory} has no 'tokenizer.chat_template': this model cannot format "
                "chat messages"
            )
        if self.chat_template is None:
            raise CheckpointError(
                f"{self.directory / TOKENIZER_CONFIG_FILE} has no 'chat_template' (and there is "
                f"no {CHAT_TEMPLATE_FILE}): this checkpoint cannot format chat messages"
            )
        return self.chat_template.render(messages, add_generation_prompt, tools, variables)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh streaming decoder for one generated sequence."""
        return IncrementalDecoder(lambda ids: self.decode(ids, skip_special_tokens))


class IncrementalDecoder:
    """Turns generated ids, one at a time, into text pieces fit to print.

    Contract: the concatenation of every `feed` result and a final `flush` equals
    `decode(all ids fed)`, and `feed` never returns a piece ending in part of a UTF-8 character
    (byte-level BPE splits characters such as emoji across tokens).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        # Ids before `_read_offset` have been printed. The window re-decoded on each step starts at
        # `_prefix_offset`, one printed piece earlier, so decoders whose output for a token depends
        # on what precedes it (leading-space stripping, byte merging) see that context.
        self._prefix_offset = 0
        self._read_offset = 0

    def feed(self, token_id: int) -> str:
        """Add one id; return the text it completes, possibly ""."""
        self._ids.append(token_id)
        printed, window = self._decode_window()
        if len(window) <= len(printed) or window.endswith(REPLACEMENT_CHAR):
            return ""  # nothing printable yet, or the window ends inside a character: wait
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(printed) :]

    def flush(self) -> str:
        """Return whatever text is still held back (an incomplete character decodes to U+FFFD)."""
        printed, window = self._decode_window()
        self._prefix_offset = self._read_offset = len(self._ids)
        return window[len(printed) :]

    def _decode_window(self) -> tuple[str, str]:
        printed = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        return printed, window


@lru_cache(maxsize=4)
def _token_bytes(path: Path, vocab_size: int) -> tuple[bytes, ...]:
    return tuple(token_bytes_table(path, vocab_size))


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found; the checkpoint needs a {TOKENIZER_FILE}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust library raises a bare Exception for any bad file
        raise CheckpointError(f"{path}: not a valid {TOKENIZER_FILE} ({e})") from e


def _token_id_lookup(
    backend: tokenizers.Tokenizer, config_path: Path
) -> Callable[[Mapping[str, Any], str], int | None]:
    """A function mapping tokenizer_config.json's special token `name` to its id (None if unset)."""

    def token_id(tokenizer_config: Mapping[str, Any], name: str) -> int | None:
        where = f"{config_path} '{name}'"
        text = special_token_text(tokenizer_config.get(name), where)
        if text is None:
            return None
        found = backend.token_to_id(text)
        if found is None:
            raise CheckpointError(f"{where}: token {text!r} is not in {TOKENIZER_FILE}")
        return found

    return token_id


def _eos_token_ids(
    directory: Path,
    tokenizer_config: Mapping[str, Any],
    token_id: Callable[[Mapping[str, Any], str], int | None],
) -> frozenset[int]:
    # Checkpoints disagree on where EOS lives (chat models often stop on several tokens, listed only
    # in generation_config.json), so generation stops on any of them.
    ids = set()
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        path = directory / name
        ids |= _id_list(read_json_object(path, required=False).get("eos_token_id"), path)
    tokenizer_eos = token_id(tokenizer_config, "eos_token")
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(ids)


def _id_list(value: Any, path: Path) -> set[int]:
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
        # bool is an int subclass; `true` here is a corrupt file, not id 1.
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CheckpointError(f"{path} 'eos_token_id': expected ids (ints >= 0), got {value!r}")
    return set(values)
