"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer`.

A GGUF carries no tokenizer.json: llama.cpp's converter stores the vocabulary
(`tokenizer.ggml.tokens`, in the byte-level spelling of tokenizer.json), the merges, each
token's type (control tokens are the special added ones, user-defined the other added ones),
the special ids, `add_bos_token`, the chat template, and the *name* of the pre-tokenizer
(`tokenizer.ggml.pre`). What a name means (the split regex, a normalizer, whether whole words
in the vocabulary skip the merges) is the tokenizer.json of the model family it names, so it is
spelled here per name. Byte-level BPE (`gpt2`) is rebuilt here; SentencePiece (`llama`: the
pieces, their scores and types) in gguf_spm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.chat_template import ChatTemplate
from hybridmoe.loader.gguf import GgufFile
from hybridmoe.loader.gguf_spm import UNKNOWN, spm_backend
from hybridmoe.loader.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types of added tokens (special, plain)
# tokenizer.ggml.model -> whether a BOS is added when the file has no `add_bos_token` (as
# llama.cpp does: SentencePiece models add one)
TOKENIZER_MODELS = {"gpt2": False, "llama": True}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5's: Qwen2's with combining marks (\p{M}) kept with their letters, out of punctuation runs
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (tiktoken's o200k_base, gpt-oss's tokenizer.json): case-split words with contractions,
# digits in threes, punctuation runs with trailing newlines or slashes
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
    "qwen35": PreTokenizerSpec(_QWEN35_SPLIT, nfc=True),  # Qwen3.5, NFC as Qwen2's
    "llama-bpe": PreTokenizerSpec(_LLAMA3_SPLIT, ignore_merges=True),  # Llama 3
    "gpt-4o": PreTokenizerSpec(_O200K_SPLIT),  # o200k: gpt-oss
}


def gguf_tokenizer(gguf: GgufFile) -> Tokenizer:
    """The Tokenizer of `gguf`; CheckpointError naming the key when a tokenizer key is missing
    or names something not supported."""
    kind = gguf.require("tokenizer.ggml.model", str)
    if kind not in TOKENIZER_MODELS:
        raise CheckpointError(
            f"{gguf.path}: metadata key 'tokenizer.ggml.model' = {kind!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece)"
        )
    tokens = gguf.require("tokenizer.ggml.tokens", list)
    types = _token_types(gguf, tokens, required=kind == "llama")
    if kind == "gpt2":
        backend = _backend(gguf, tokens, _pre_tokenizer(gguf))
    else:
        backend = spm_backend(gguf, tokens, types)
    _add_added_tokens(backend, tokens, types)
    backend.post_processor = _post_processor(gguf, tokens, TOKENIZER_MODELS[kind])
    special = _special_ids(gguf, len(tokens))
    return Tokenizer(
        directory=gguf.path,
        backend=backend,
        eos_token_ids=frozenset(i for k in ("eos", "eot") if (i := special[k]) is not None),
        bos_token_id=special["bos"],
        pad_token_id=special["pad"],
        chat_template=_chat_template(gguf, tokens, special),
    )


def _pre_tokenizer(gguf: GgufFile) -> PreTokenizerSpec:
    pre = gguf.get("tokenizer.ggml.pre", str, "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{gguf.path}: metadata key 'tokenizer.ggml.pre' = {pre!r} is not supported "
            f"(supported: {', '.join(PRE_TOKENIZERS)})"
        )
    return PRE_TOKENIZERS[pre]


def _token_types(gguf: GgufFile, tokens: list[str], required: bool) -> list[int]:
    """`tokenizer.ggml.token_type`, one per token (absent and not `required`: all normal)."""
    types = gguf.require("tokenizer.ggml.token_type", list) if required else None
    if types is None:
        types = gguf.get("tokenizer.ggml.token_type", list, [1] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{gguf.path}: 'tokenizer.ggml.token_type' has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    return types


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
    return backend


def _add_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (and the unknown token) become special added tokens, user-defined ones
    plain added tokens: both are matched whole in the text, before the pre-tokenizer, as
    tokenizer.json's are."""
    for token, kind in zip(tokens, types, strict=True):
        if kind in (CONTROL, UNKNOWN):
            backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])
        elif kind == USER_DEFINED:
            backend.add_tokens([AddedToken(token, special=False, normalized=False)])


def _post_processor(
    gguf: GgufFile, tokens: list[str], add_bos: bool
) -> processors.PostProcessor | None:
    """BOS/EOS added around the text where the file says so (`add_bos_token`, absent:
    `add_bos`; `add_eos_token`, absent: no)."""
    ends = []
    for end, flag, default in (("bos", "add_bos_token", add_bos), ("eos", "add_eos_token", False)):
        if gguf.get(f"tokenizer.ggml.{flag}", bool, default):
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
