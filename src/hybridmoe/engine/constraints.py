"""Grammar-constrained decoding: a per-sequence mask of the tokens a grammar allows next.

`Grammar` says what the output must be (any JSON object, a JSON schema, or a Lark grammar);
`GrammarCompiler` (one per engine: it holds the vocabulary) checks grammars and makes one
`TokenConstraint` per sequence; the sequence's Sampler masks its logits with
`constraint.allowed()` and calls `constraint.advance(token)` with the token it picked.
An unconstrained sequence has no constraint and does no per-token work at all.

The matching is llguidance's (docs/proposals/0004-structured-output.md has the comparison).
JSON is compact, as `json.dumps` writes it (", " and ": " separators, no other whitespace), so a
model cannot spend its tokens on whitespace.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    import llguidance

GRAMMAR_KINDS = ("json_object", "json_schema", "lark")
# Read by llguidance from a schema's "x-guidance" key; also how a %json schema in Lark gets them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    """The llguidance module (with llguidance.numpy), imported on first use: an engine only
    needs it once a request is constrained."""
    import llguidance
    import llguidance.numpy  # noqa: F401  (its attribute of the package from then on)

    return llguidance


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class Grammar:
    """What a constrained output must match. `source` is the JSON schema (text) for
    "json_schema", a Lark grammar (llguidance's dialect: `%json {schema}` embeds a schema) for
    "lark", and "" for "json_object" (any JSON object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str) or (self.kind != "json_object") != bool(self.source):
            raise ValueError(f"a {self.kind} grammar needs a source iff it is not json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Grammar:
        return cls("json_schema", json.dumps(schema))

    def llguidance_grammar(self) -> str:
        """This grammar in llguidance's serialised form."""
        if self.kind == "lark":
            return _llguidance().LLMatcher.grammar_from_lark(self.source)
        schema = '{"type": "object"}' if self.kind == "json_object" else self.source
        try:
            matcher = _llguidance().LLMatcher
            return matcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"not a JSON schema: {e}") from e


class TokenConstraint:
    """The grammar state of one sequence. `allowed()` is the mask of the next token;
    `advance(token)` consumes a token the mask allowed (anything else is a bug: RuntimeError)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher, self._vocab_size = matcher, vocab_size
        self._llg_numpy = _llguidance().numpy
        self._bitmask = self._llg_numpy.allocate_token_bitmask(1, vocab_size)  # int32 [1, W]

    def allowed(self) -> Tensor:
        """bool [V]: True for the tokens the grammar accepts next (EOS once it is complete)."""
        self._llg_numpy.fill_next_token_bitmask(self._matcher, self._bitmask)
        self._check()
        # Bit j of word w is token 32w + j: little-endian words, so little-endian bits of bytes.
        bits = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")  # uint8 [32W]
        return torch.from_numpy(bits[: self._vocab_size].view(np.bool_))

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            self._check()
            raise RuntimeError(f"the grammar refused token {token_id}, which its mask allowed")

    @property
    def accepting(self) -> bool:
        """The output so far is a whole match of the grammar."""
        return self._matcher.is_accepting()

    def accepts(self, token_id: int) -> bool:
        """Would `advance(token_id)` succeed? (The reference the mask is tested against: the
        mask is exactly these tokens, except where the grammar forces the next bytes.)"""
        return self._matcher.validate_tokens([token_id]) == 1

    @property
    def forcing(self) -> bool:
        """The grammar allows one continuation only (e.g. a schema's next key). The mask then
        keeps the tokens of that text's own tokenization, a subset of what `accepts` allows
        (a key spelt in odd pieces would still match, but is not how the model writes it)."""
        return bool(self._matcher.compute_ff_tokens())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._matcher.get_error()}")


def mask_logits(logits: Tensor, allowed: Tensor) -> Tensor:
    """`logits` [V] with the tokens not `allowed` (bool [V]) set to -inf; a new tensor.
    Host logits are masked by numpy: one pass, no thread pool (torch's OpenMP workers made
    this 150k-element op cost milliseconds on a busy machine). Equal to mask_logits_reference."""
    if logits.device.type != "cpu":
        return mask_logits_reference(logits, allowed)
    values = logits.numpy()
    return torch.from_numpy(np.where(allowed.numpy(), values, values.dtype.type(-np.inf)))


def mask_logits_reference(logits: Tensor, allowed: Tensor) -> Tensor:
    return torch.where(allowed.to(logits.device), logits, float("-inf"))


class GrammarCompiler:
    """Compiles grammars against one vocabulary: `token_bytes[i]` is the text of id i (b"" for
    ids that stand for no text: they are never allowed), generation ends on `eos_ids`, and
    `encode` tokenises text as the checkpoint does (llguidance uses it for forced strings)."""

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        eos_ids: Sequence[int],
        special_ids: Sequence[int],
        encode: Callable[[str], list[int]],
    ) -> None:
        if not eos_ids:
            raise GrammarError("constrained decoding needs an end-of-sequence token")
        vocabulary = _Vocabulary(list(token_bytes), sorted(eos_ids), list(special_ids), encode)
        llguidance = _llguidance()
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(vocabulary),
            n_vocab=len(token_bytes),
            eos_token=sorted(eos_ids),
        )
        self.vocab_size = len(token_bytes)

    def check(self, grammar: Grammar) -> str:
        """The compiled grammar; GrammarError naming the problem if it does not compile."""
        compiled = grammar.llguidance_grammar()
        failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(
            compiled, self._tokenizer
        )
        # A warning is a part of the schema llguidance would not enforce: refused, not ignored.
        if failed or messages:
            raise GrammarError("; ".join(messages) or "the grammar does not compile")
        return compiled

    def constraint(self, grammar: Grammar) -> TokenConstraint:
        """A fresh TokenConstraint for one sequence; GrammarError if `grammar` does not compile."""
        matcher = _llguidance().LLMatcher(self._tokenizer, self.check(grammar), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return TokenConstraint(matcher, self.vocab_size)


class _Vocabulary:
    """The tokenizer object llguidance.TokenizerWrapper reads."""

    def __init__(self, tokens, eos_ids, special_ids, encode) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos_ids[0], None
        self.special_token_ids = special_ids
        self._encode = encode

    def __call__(self, text: str) -> list[int]:
        return self._encode(text)
