"""Train the demo byte-level BPE tokenizer and write it to src/hybridmoe/demo/assets/.

The training text is the source (docstrings included) of a fixed, sorted list of standard library
.py files, so a rerun on the same Python version writes byte-identical files.

Run: python scripts/build_demo_tokenizer.py
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS_DIR = Path(__file__).resolve().parents[1] / "src" / "hybridmoe" / "demo" / "assets"
VOCAB_SIZE = 4096
# Order fixes the ids: <|endoftext|> is 0.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Files under the standard library directory whose path has been stable across Python 3.10-3.13.
# Sorted, so the corpus order is fixed.
CORPUS_FILES = sorted(
    [
        "abc.py",
        "argparse.py",
        "base64.py",
        "bisect.py",
        "calendar.py",
        "collections/__init__.py",
        "contextlib.py",
        "copy.py",
        "csv.py",
        "dataclasses.py",
        "difflib.py",
        "enum.py",
        "fractions.py",
        "functools.py",
        "gettext.py",
        "heapq.py",
        "json/decoder.py",
        "json/encoder.py",
        "locale.py",
        "logging/__init__.py",
        "pprint.py",
        "queue.py",
        "random.py",
        "shlex.py",
        "statistics.py",
        "string.py",
        "textwrap.py",
        "threading.py",
        "tokenize.py",
        "typing.py",
        "unittest/case.py",
        "uuid.py",
        "warnings.py",
    ]
)
# ChatML as Qwen writes it, without a default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus() -> Iterator[str]:
    # Read the .py files rather than import: some modules (abc, ...) are frozen in the interpreter.
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    for i, relative_path in enumerate(CORPUS_FILES, 1):
        text = (stdlib_dir / relative_path).read_text(encoding="utf-8")
        print(f"[{i}/{len(CORPUS_FILES)}] {relative_path}: {len(text):,} chars", flush=True)
        yield text


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any text (emoji, CJK) encodes even if the corpus lacks it.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    print(f"training byte-level BPE, vocab {VOCAB_SIZE}, on {len(CORPUS_FILES)} stdlib files")
    tokenizer = train_tokenizer()
    ASSETS_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer_path = ASSETS_DIR / "tokenizer.json"
    # Not pretty-printed: indentation would double the file's size.
    tokenizer.save(str(tokenizer_path), pretty=False)
    config_path = ASSETS_DIR / "tokenizer_config.json"
    config_path.write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    size_kb = tokenizer_path.stat().st_size / 1024
    print(f"wrote {tokenizer_path} ({size_kb:.0f} KB, vocab {tokenizer.get_vocab_size()})")
    print(f"wrote {config_path}")


if __name__ == "__main__":
    main()
