"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: llama.cpp's converter stores the vocabulary
(`tokenizer.ggml.tokens`, in the byte-level spelling of tokenizer.json), the merges, each
token's type (control tokens are the special added ones, user-defined the other added ones),
the special ids, `add_bos_token`, the chat template, and the *name* of the pre-tokenizer
(`tokenizer.ggml.pre`). What a name means (the split regex, a normalizer, whether whole words
in the vocabulary skip the merges) is the tokenizer.json of the model family it names, so it is
spelled here per name. Only byte-level BPE (`gpt2`) is rebuilt; SentencePiece (`llama`) is
refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.chat_template import ChatTemplate
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types of added tokens (special, plain)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """What one `tokenizer.ggml.pre` name stands for, as its family's tokenizer.json has it."""

    split: str | None  # a Split regex before ByteLevel; None: ByteLevel's own (GPT-2) regex
    nfc: bool = False  # an NFC normalizer (Qwen2's tokenizer.json has one)
    ignore_merges: bool = False  # a pre-token that is a whole vocabulary entry skips the merges


PRE_TOKENIZERS = {
    "default": PreTokenizerSpec(None),
    "gpt-2": PreTokenizerSpec(None),
    "olmo": PreTokenizerSpec(None),  # OLMo's (GPT-NeoX) ByteLevel with the GPT-2 regex
    "qwen2": PreTokenizerSpec(_QWEN2_SPLIT, nfc=True),
    "llama-bpe": PreTokenizerSpec(_LLAMA3_SPLIT, ignore_merges=True),  # Llama 3
}


def gguf_tokenizer(gguf: GgufFile) -> Tokenizer:
    """The Tokenizer of `gguf`; CheckpointError naming the key when a tokenizer key is missing
    or names something not supported."""
    kind = gguf.require("tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise CheckpointError(
            f"{gguf.path}: metadata key 'tokenizer.ggml.model' = {kind!r} is not supported "
            "(supported: 'gpt2', byte-level BPE)"
        )
    pre = gguf.get("tokenizer.ggml.pre", str, "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{gguf.path}: metadata key 'tokenizer.ggml.pre' = {pre!r} is not supported "
            f"(supported: {', '.join(PRE_TOKENIZERS)})"
        )
    tokens = gguf.require("tokenizer.ggml.tokens", list)
    backend = _backend(gguf, tokens, PRE_TOKENIZERS[pre])
    special = _special_ids(gguf, len(tokens))
    return Tokenizer(
        directory=gguf.path,
        backend=backend,
        eos_token_ids=frozenset(i for k in ("eos", "eot") if (i := special[k]) is not None),
        bos_token_id=special["bos"],
        pad_token_id=special["pad"],
        chat_template=_chat_template(gguf, tokens, special),
    )


def _backend(gguf: GgufFile, tokens: list[str], spec: PreTokenizerSpec) -> tokenizers.Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges", list, [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{gguf.path}: 'tokenizer.ggml.tokens' repeats a token")
    try:
        bpe = models.BPE(vocab, merges, ignore_merges=spec.ignore_merges)
    except Exception as exc:  # the Rust library raises a bare Exception
        raise CheckpointError(f"{gguf.path}: 'tokenizer.ggml.merges' is invalid ({exc})") from exc
    backend = tokenizers.Tokenizer(bpe)
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    if spec.split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(spec.split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    _add_added_tokens(gguf, backend, tokens)
    backend.post_processor = _post_processor(gguf, tokens)
    return backend


def _add_added_tokens(gguf: GgufFile, backend: tokenizers.Tokenizer, tokens: list[str]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens: both
    are matched whole in the text, before the pre-tokenizer, as tokenizer.json's are."""
    types = gguf.get("tokenizer.ggml.token_type", list)
    if types is None:
        return
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{gguf.path}: 'tokenizer.ggml.token_type' has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    for token, kind in zip(tokens, types, strict=True):
        if kind in (CONTROL, USER_DEFINED):
            added = AddedToken(token, special=kind == CONTROL, normalized=False)
            (backend.add_special_tokens if kind == CONTROL else backend.add_tokens)([added])


def _post_processor(gguf: GgufFile, tokens: list[str]) -> processors.PostProcessor | None:
    """BOS/EOS added around the text where the file says so (`add_bos_token`, absent: no)."""
    ends = []
    for end, flag in (("bos", "add_bos_token"), ("eos", "add_eos_token")):
        if gguf.get(f"tokenizer.ggml.{flag}", bool, False):
            token_id = gguf.require(f"tokenizer.ggml.{end}_token_id")
            ends.append((end, tokens[token_id], token_id))
    if not ends:
        return None
    single = [f"{t}:0" for e, t, _ in ends if e == "bos"] + ["$A:0"]
    single += [f"{t}:0" for e, t, _ in ends if e == "eos"]
    return processors.TemplateProcessing(
        single=" ".join(single), special_tokens=[(t, i) for _, t, i in ends]
    )


def _special_ids(gguf: GgufFile, vocab_size: int) -> dict[str, int | None]:
    found = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("eot", "eot"), ("pad", "padding")):
        token_id = gguf.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise CheckpointError(
                f"{gguf.path}: 'tokenizer.ggml.{key}_token_id' = {token_id} is not a token id "
                f"(vocabulary of {vocab_size})"
            )
        found[name] = token_id
    return found


def _chat_template(
    gguf: GgufFile, tokens: list[str], special: dict[str, int | None]
) -> ChatTemplate | None:
    source = gguf.get("tokenizer.chat_template", str)
    if source is None:
        return None
    named = {
        f"{name}_token": tokens[i]
        for name in ("bos", "eos", "pad")
        if (i := special[name]) is not None
    }
    return ChatTemplate(source, f"{gguf.path} 'tokenizer.chat_template'", named)
