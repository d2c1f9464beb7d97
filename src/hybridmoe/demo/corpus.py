"""The demo model's text: the Python standard library's own source, with a fixed held-out split.

Every machine that runs hybridmoe has this text, and the PSF licence lets the model trained on
it ship with the package. The split is by file, decided by a hash of the file's path, so it
does not depend on which other files a Python version has.
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

# Directories left out: installed third-party packages, test suites, lib2to3 (Python 2 in its
# test data), codec tables and pydoc's generated topic strings (data, not prose or code).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "lib2to3"}
)
# Generated per build, or not Python as people write it (this.py is ROT13).
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata", "this.py")
HELD_OUT_ONE_IN = 20  # ~5% of the files
SEPARATOR = "<|endoftext|>"  # ends every file in a token stream


@dataclass(frozen=True)
class CorpusSplit:
    """Paths relative to the standard library directory, sorted."""

    train: tuple[str, ...]
    held_out: tuple[str, ...]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """Every .py file of the standard library outside the excluded directories, sorted."""
    root = root or stdlib_dir()
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if EXCLUDED_DIRS.isdisjoint(parts[:-1]) and not parts[0].startswith(EXCLUDED_PREFIXES):
            files.append("/".join(parts))
    if not files:
        raise FileNotFoundError(f"no standard library sources under {root}")
    return sorted(files)


def is_held_out(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELD_OUT_ONE_IN == 0


def split_corpus(root: Path | None = None) -> CorpusSplit:
    files = corpus_files(root)
    held_out = tuple(f for f in files if is_held_out(f))
    return CorpusSplit(train=tuple(f for f in files if not is_held_out(f)), held_out=held_out)


def read_texts(files: tuple[str, ...] | list[str], root: Path | None = None) -> list[str]:
    root = root or stdlib_dir()
    return [(root / f).read_text(encoding="utf-8") for f in files]


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
    """The texts' tokens end to end, each text followed by <|endoftext|>."""
    separator = tokenizer.token_to_id(SEPARATOR)
    if separator is None:
        raise ValueError(f"the tokenizer has no {SEPARATOR} token to end each file with")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(separator)
    return ids


def encode_files(
    tokenizer: Tokenizer, files: tuple[str, ...] | list[str], root: Path | None = None
) -> list[int]:
    return token_stream(tokenizer, read_texts(files, root))
