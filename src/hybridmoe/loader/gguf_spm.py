"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model` = "llama": Llama 2, Mistral and
Mixtral files) rebuilt as a `tokenizers` BPE with byte fallback, the model Hugging Face's
LlamaTokenizerFast is.

llama.cpp's converter stores the SentencePiece pieces as `tokenizer.ggml.tokens` (spaces
spelled "▁"), each piece's score, and its type (normal, unknown, control, user-defined, unused,
byte: the 256 `<0xNN>` pieces text falls back to where no piece covers a character), but no
merges: SentencePiece BPE merges, at every step, the adjacent pair whose joined piece has the
highest score. So the merges are derived from the scores: every split of a normal piece into
two normal pieces, ranked by the joined piece's score (then its id, then the parts' ids, as
transformers' SentencePiece conversion orders them). `tokenizer.ggml.add_space_prefix`
(SentencePiece's add_dummy_prefix, default true) puts a "▁" before the text and takes one
leading space off what is decoded.
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, normalizers

from hybridmoe.errors import CheckpointError
from hybridmoe.loader.gguf import GgufFile

NORMAL, UNKNOWN, BYTE = 1, 2, 6  # llama.cpp token types (CONTROL 3, USER_DEFINED 4, UNUSED 5)
SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def spm_backend(gguf: GgufFile, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """The BPE over `tokens` (with their llama.cpp `types`) and the file's scores, with
    SentencePiece's space handling; added tokens and the post-processor are the caller's."""
    scores = gguf.require("tokenizer.ggml.scores", list)
    if len(scores) != len(tokens):
        raise CheckpointError(
            f"{gguf.path}: 'tokenizer.ggml.scores' has {len(scores)} entries for "
            f"{len(tokens)} tokens"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{gguf.path}: 'tokenizer.ggml.tokens' repeats a token")
    unknown = gguf.get("tokenizer.ggml.unknown_token_id")
    if unknown is None and UNKNOWN in types:
        unknown = types.index(UNKNOWN)
    bpe = models.BPE(
        vocab,
        score_merges(tokens, scores, types),
        unk_token=None if unknown is None else tokens[unknown],
        fuse_unk=True,
        byte_fallback=BYTE in types,
    )
    backend = tokenizers.Tokenizer(bpe)
    prefix = gguf.get("tokenizer.ggml.add_space_prefix", bool, True)
    steps = [normalizers.Replace(" ", SPACE)]
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE)] if prefix else []) + steps
    )
    chain = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(
        chain + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else [])
    )
    return backend


def score_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The merges SentencePiece BPE makes, best first: (left, right) for every normal piece
    that is two normal pieces joined, ranked by the joined piece's score."""
    normal = {token: i for i, (token, kind) in enumerate(zip(tokens, types, strict=True))}
    normal = {token: i for token, i in normal.items() if types[i] == NORMAL}
    ranked = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
