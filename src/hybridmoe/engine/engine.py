"""Engine: load a checkpoint, then prefill and decode batches of prompts with a KV cache."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hybridmoe.engine import steps
from hybridmoe.engine.config import EngineConfig
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.engine.moe_runtime import MoeRuntime, create_moe_runtime
from hybridmoe.engine.placement import plan_device_memory
from hybridmoe.engine.sampling import SamplingParams
from hybridmoe.engine.sequence import Completion, Sequence
from hybridmoe.engine.stats import GenerationStats
from hybridmoe.errors import CheckpointError
from hybridmoe.loader.checkpoint import load_model, parse_dtype
from hybridmoe.loader.tokenizer import Tokenizer
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.platform.base import Platform, create_platform


class Engine:
    def __init__(self, model: MoeCausalLM, tokenizer: Tokenizer | None, config: EngineConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        platform = create_platform(config.device)
        runtime = None
        try:  # a failure (e.g. out of memory in model.to) closes what was created
            memory = plan_device_memory(model, config, platform)
            runtime = create_moe_runtime(model, config.offload, platform, config.progress, memory)
            model.to(platform.device)
        except BaseException:
            _close_after_failure(runtime, platform)
            raise
        self.moe_runtime = runtime
        self.eos_ids = frozenset(model.cfg.eos_token_ids) | (
            tokenizer.eos_token_ids if tokenizer else frozenset()
        )
        self.stats = GenerationStats()

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        if config.threads:
            torch.set_num_threads(config.threads)
        directory = Path(path)
        dtype = None if config.dtype == "auto" else parse_dtype(config.dtype)
        model = load_model(directory, dtype, config.progress)
        has_tokenizer = (directory / "tokenizer.json").exists()
        tokenizer = Tokenizer.from_dir(directory) if has_tokenizer else None
        return cls(model, tokenizer, config)

    def close(self) -> None:
        """Stops the CPU expert workers and releases the model; the engine is unusable after."""
        self.moe_runtime.close()
        self.model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public generation API -------------------------------------------------------------

    def generate_ids(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Generated token ids per prompt (EOS included when it ended the sequence)."""
        seqs = [self.new_sequence(ids, params, with_text=False) for ids in prompts]
        self._run_to_end(seqs)
        return [seq.output_ids for seq in seqs]

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        seqs = [self.new_sequence(self.encode(p), params, with_text=True) for p in prompts]
        self._run_to_end(seqs)
        return [seq.completion() for seq in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
        """Yields the text of one completion piece by piece as it is generated.

        `prompt` is text (tokenised with the checkpoint's special tokens) or token ids."""
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        seq = self.new_sequence(ids, params, with_text=True)
        for deltas in self._run([seq]):
            if deltas[0]:
                yield deltas[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.require_tokenizer().encode(text, add_special_tokens)
        if not ids:
            raise ValueError("prompt is empty after tokenisation")
        return ids

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise CheckpointError("checkpoint has no tokenizer.json; text generation needs one")
        return self.tokenizer

    # --- the generation loop ---------------------------------------------------------------

    def new_sequence(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        with_text: bool,
        max_len: int | None = None,
    ) -> Sequence:
        """A fresh Sequence for `prompt_ids`; prompt + output stay below `max_len` (default: the
        model's context window). Raises ValueError if the prompt alone does not fit."""
        limit = max_len or self.model.cfg.max_position_embeddings
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context window is {limit}")
        detok = self.require_tokenizer().incremental_decoder() if with_text else None
        return Sequence(list(prompt_ids), params, self.eos_ids, limit, detok)

    def _run_to_end(self, seqs: list[Sequence]) -> None:
        for _ in self._run(seqs):
            pass

    def _run(self, seqs: list[Sequence]) -> Iterator[list[str]]:
        """Prefills then decodes `seqs` together; yields each step's text deltas per sequence."""
        if not seqs:
            return
        if len(seqs) > self.config.max_batch:
            raise ValueError(f"{len(seqs)} prompts exceed max_batch={self.config.max_batch}")
        max_len = max(min(len(s.prompt_ids) + s.params.max_tokens, s.max_len) for s in seqs)
        cache = KVCache(self.model.cfg, len(seqs), max_len, self.model.dtype, self.model.device)
        self.stats = GenerationStats(prompt_tokens=sum(len(s.prompt_ids) for s in seqs))
        self.moe_runtime.reset_stats()
        start = time.perf_counter()
        yield [steps.prefill(self.model, seq, row, cache) for row, seq in enumerate(seqs)]
        self.stats.prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        while any(not s.finished for s in seqs):
            yield self._decode_step(seqs, cache)
        self.stats.decode_s = time.perf_counter() - start
        self.stats.experts = self.moe_runtime.stats()

    def _decode_step(self, seqs: list[Sequence], cache: KVCache) -> list[str]:
        rows = [row for row, seq in enumerate(seqs) if not seq.finished]
        live_deltas = steps.decode(self.model, rows, [seqs[r] for r in rows], cache)
        deltas = [""] * len(seqs)
        for row, delta in zip(rows, live_deltas, strict=True):
            deltas[row] = delta
        self.stats.decode_tokens += len(rows)
        return deltas


def _close_after_failure(runtime: MoeRuntime | None, platform: Platform) -> None:
    """Join the CPU workers and unpin the host banks of a half-built engine; the platform is
    closed even when the runtime's close fails (close() is idempotent)."""
    try:
        if runtime is not None:
            runtime.close()
    finally:
        platform.close()
