"""The tokenizer rebuilt from a GGUF's metadata encodes and decodes exactly like the tokenizer.json
it was written from, for each supported `tokenizer.ggml.pre`; transformers' own GGUF tokenizer
is a second oracle."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from gguf_checkpoints import write_gguf
from hf_checkpoints import write_hf_checkpoint
from hybridmoe.demo import demo_checkpoint_dir
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.gguf_tokenizer import (
    _LLAMA3_SPLIT,
    _O200K_SPLIT,
    _QWEN2_SPLIT,
    _QWEN35_SPLIT,
    gguf_tokenizer,
)
from hybridmoe.loader.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "Hello, world! It's 2024; we'll see.",
    "def f(x):\n    return x * 2  # double\n\n\tif x:\n\t\tpass\n",
    "  two leading spaces and trailing  \n\n\n   \t ",
    "héllo wörld — naïve café, cafe\u0301 (decomposed)",
    "emoji 😀👍🏽 and a flag 🇯🇵, digits 1234567 3.14159",
    "日本語のテキストと中文，한국어",
    "नमस्ते दुनिया, ภาษาไทย; a mark NFC cannot compose: q\u0301",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "I'M SHOUTING, YOU'RE NOT'S <think>ok",
    "camelCaseName HTTPServer xmlHTTPRequest DON'T Don'tStop path/to/file.py//\n\r\n",
    "",
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _pre_tokenizer(pre: str) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    if pre in ("default", "gpt-2", "olmo"):
        return {**byte_level, "use_regex": True}
    split = {
        "qwen2": _QWEN2_SPLIT,
        "qwen35": _QWEN35_SPLIT,
        "llama-bpe": _LLAMA3_SPLIT,
        "gpt-4o": _O200K_SPLIT,
    }[pre]
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
            {**byte_level, "use_regex": False},
        ],
    }


def original_tokenizer(pre: str, directory: Path) -> tuple[dict, Path]:
    """The demo's byte-level BPE vocabulary with the pre-tokenizer (and normalizer, BOS,
    ignore_merges) that tokenizer.json files of `pre`'s family have."""
    spec = copy.deepcopy(json.loads((demo_checkpoint_dir() / "tokenizer.json").read_text()))
    spec["pre_tokenizer"] = _pre_tokenizer(pre)
    spec["normalizer"] = {"type": "NFC"} if pre in ("qwen2", "qwen35") else None
    spec["model"]["ignore_merges"] = pre == "llama-bpe"
    spec["added_tokens"].append(
        {
            "id": 4096,
            "content": "<think>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }  # fmt: skip
    )
    if pre == "llama-bpe":
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                "tokens": ["<|im_start|>"]}},
        }  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return {**spec, "pre": pre, "add_bos": pre == "llama-bpe"}, directory / "tokenizer.json"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint("qwen3_moe", "mha_tied_top1", tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize(
    "pre", ["qwen2", "qwen35", "llama-bpe", "olmo", "default", "gpt-2", "gpt-4o"]
)
def test_gguf_tokenizer_encodes_and_decodes_like_the_original(pre, tiny_hf, tmp_path) -> None:
    spec, path = original_tokenizer(pre, tmp_path / "orig")
    gguf_path = write_gguf(tiny_hf, tmp_path / "m.gguf", tokenizer=spec, chat_template=TEMPLATE)
    ours = gguf_tokenizer(GgufFile(gguf_path))
    original = tokenizers.Tokenizer.from_file(str(path))
    for text in CORPUS + [" ".join(CORPUS)]:
        for special in (True, False):
            expected = original.encode(text, add_special_tokens=special).ids
            assert ours.encode(text, special) == expected, (pre, text, special)
        ids = original.encode(text).ids
        for skip in (True, False):
            assert ours.decode(ids, skip) == original.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token_id == 1 and ours.eos_token_ids == {2}


def test_gguf_tokenizer_chat_template_and_transformers_oracle(tiny_hf, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    spec, _ = original_tokenizer("qwen2", tmp_path / "orig")
    gguf_path = write_gguf(tiny_hf, tmp_path / "m.gguf", tokenizer=spec, chat_template=TEMPLATE)
    ours = gguf_tokenizer(GgufFile(gguf_path))
    messages = [{"role": "user", "content": "hi 👋"}]
    assert ours.apply_chat_template(messages) == Tokenizer.from_dir(
        _dir_with_template(tmp_path / "orig")
    ).apply_chat_template(messages)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_path.name)
    for text in CORPUS:
        if text == CORPUS[3]:
            continue  # transformers' GGUF tokenizer has no NFC step; Qwen2's tokenizer.json has
        assert ours.encode(text, False) == theirs.encode(text, add_special_tokens=False), text


def _dir_with_template(directory: Path) -> Path:
    config = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_unsupported_tokenizer_model_is_named(tiny_hf, tmp_path) -> None:
    spec, _ = original_tokenizer("default", tmp_path / "orig")
    gguf_path = write_gguf(tiny_hf, tmp_path / "m.gguf", tokenizer={**spec, "pre": "falcon"})
    with pytest.raises(ValueError, match="'tokenizer.ggml.pre' = 'falcon' is not supported"):
        gguf_tokenizer(GgufFile(gguf_path))
