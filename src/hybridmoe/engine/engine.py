"""Engine: load a checkpoint, then generate through its one Scheduler."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from hybridmoe.engine.config import HEAD_FORMATS, EngineConfig
from hybridmoe.engine.constraints import GrammarCompiler
from hybridmoe.engine.moe_runtime import MoeRuntime, create_moe_runtime
from hybridmoe.engine.placement import plan_device_memory, resolve_decode_target
from hybridmoe.engine.sampling import SamplingParams
from hybridmoe.engine.scheduler import OutputCallback, RequestOutput, ScheduledRequest, Scheduler
from hybridmoe.engine.sequence import Completion, Sequence
from hybridmoe.engine.stats import GenerationStats
from hybridmoe.errors import CheckpointError
from hybridmoe.kernels.compile_progress import compile_progress
from hybridmoe.loader.checkpoint import parse_dtype
from hybridmoe.loader.hub import resolve_model
from hybridmoe.loader.tokenizer import Tokenizer
from hybridmoe.models.loading import load_checkpoint
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.platform.base import Platform, create_platform, resolve_device
from hybridmoe.quant.formats import weight_format

log = logging.getLogger(__name__)
WARM_UP_PROMPT_IDS = [0, 1]  # any ids in every vocabulary: the tokens do not matter
WARM_UP_PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)  # a prefill and a decode step


def _huge_pages(config: EngineConfig) -> str:
    """What of a GGUF's mapping goes onto huge pages (loader/gguf.GgufFile): all with
    --huge-pages, else the tensors every decode step reads whole where the host computes on
    them (the cpu device; an accelerator copies them once and the host's would stay
    resident for nothing)."""
    if config.huge_pages:
        return "all"
    return "streamed" if resolve_device(config.device).type == "cpu" else "none"


class Engine:
    """A loaded checkpoint and its one Scheduler, over a KV cache of max_batch rows x
    max_seq_len positions (EngineConfig.resolve_max_seq_len) and a prefix cache
    (resolve_prefix_cache_blocks) allocated here, as placement plans them. generate and
    stream submit their prompts and step the scheduler until those finish; `serve` runs the
    same scheduler on its main thread instead."""

    def __init__(self, model: MoeCausalLM, tokenizer: Tokenizer | None, config: EngineConfig):
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len = config.resolve_max_seq_len(model.cfg.max_position_embeddings)
        platform = create_platform(config.device)
        runtime = None
        try:  # a failure (e.g. out of memory in model.to) closes what was created
            config = resolve_decode_target(model, config, platform)  # `auto` -> a target
            config = _prefix_cache_for(model, config)
            memory = plan_device_memory(model, config, platform)
            runtime = create_moe_runtime(model, config.offload, platform, config.progress, memory)
            model.set_activation_quant(config.offload.activation_quant)
            model.to(platform.device)
            prefix_blocks = config.resolve_prefix_cache_blocks(self.max_seq_len)
            self.scheduler = Scheduler(
                model,
                runtime,
                config.max_batch,
                self.max_seq_len,
                prefix_blocks,
                attention_kernel=config.attention_kernel,
            )
        except BaseException:
            _close_after_failure(runtime, platform)
            raise
        self.moe_runtime, self.config = runtime, config
        self.eos_ids = frozenset(model.cfg.eos_token_ids) | (
            tokenizer.eos_token_ids if tokenizer else frozenset()
        )
        self.stats = GenerationStats()
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of SamplingParams.grammar over this checkpoint's vocabulary (built on
        first use). Raises CheckpointError without a tokenizer."""
        if self._grammars is None:
            tokenizer = self.require_tokenizer()
            self._grammars = GrammarCompiler(
                tokenizer.token_bytes(self.model.cfg.vocab_size),
                sorted(self.eos_ids),
                sorted(tokenizer.special_token_ids),
                lambda text: tokenizer.encode(text, add_special_tokens=False),
            )
        return self._grammars

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        if config.threads:
            torch.set_num_threads(config.threads)
        dtype = None if config.dtype == "auto" else parse_dtype(config.dtype)
        model, tokenizer = load_checkpoint(
            resolve_model(str(path), config.gguf_file), dtype, config.progress, _huge_pages(config)
        )
        if config.dense_format != "auto":
            head_format = weight_format(HEAD_FORMATS[config.dense_format])
            model.quantize_dense(weight_format(config.dense_format), head_format)
        with compile_progress(enabled=config.progress):  # the CPU expert kernels compile here
            return cls(model, tokenizer, config)

    def warm_up(self) -> None:
        """One tiny request (a prefill of 2 tokens and a decode step) through the engine, so
        that every kernel on its path is compiled, or loaded from numba's disk cache, before a
        request that is timed or waited on: on a machine's first run that takes about half a
        minute (a counter on stderr with config.progress: kernels/compile_progress.py); from
        the cache, one short request. The expert-cache counters restart afterwards and `stats`
        keeps the last request's counts. With max_seq_len under 3 the prompt is shorter (at
        max_seq_len 1, nothing can run: nothing is done)."""
        prompt = WARM_UP_PROMPT_IDS[: self.max_seq_len - 1]  # a prompt must leave a position
        if not prompt:
            return
        stats = self.stats
        with compile_progress(enabled=self.config.progress):
            self.generate_ids([prompt], WARM_UP_PARAMS)
        self.moe_runtime.reset_stats()
        self.stats = stats

    def close(self) -> None:
        """Fails the requests still queued or running, stops the CPU expert workers and
        releases the model and the KV cache; the engine is unusable after."""
        self.scheduler.close()
        self.moe_runtime.close()
        self.model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- public generation API -------------------------------------------------------------

    def generate_ids(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Generated token ids per prompt, in prompt order (EOS included when it ended the
        sequence). A prompt's tokens are those it gets alone where the decode step is batch
        invariant (bfloat16 on the host decode path, to the bit: docs/architecture.md; SDPA's
        padded batches may round a near tie otherwise); prompts beyond max_batch wait for a
        free KV-cache row. `stats` then holds this call's counts."""
        seqs = [self.new_sequence(ids, params, with_text=False) for ids in prompts]
        self._run_to_end(seqs)
        return [seq.output_ids for seq in seqs]

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        """One Completion per prompt, in prompt order; as generate_ids."""
        seqs = [self.new_sequence(self.encode(p), params, with_text=True) for p in prompts]
        self._run_to_end(seqs)
        return [seq.completion() for seq in seqs]

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
        """Yields the text of one completion piece by piece as it is generated.

        `prompt` is text (tokenised with the checkpoint's special tokens) or token ids."""
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        seq = self.new_sequence(ids, params, with_text=True)
        for output in self._run([seq]):
            if output.text:
                yield output.text

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, on_output: OutputCallback
    ) -> ScheduledRequest:
        """Queue a text request on the engine's scheduler, for the thread that runs it (the
        server's). Raises ValueError if the prompt does not fit in max_seq_len and
        SchedulerClosed once the scheduler is closed."""
        seq = self.new_sequence(prompt_ids, params, with_text=True)
        return self.scheduler.submit(seq, on_output)

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
        """A fresh Sequence for `prompt_ids`; prompt + output stay below `max_len` (default:
        max_seq_len, what the engine's KV cache holds). Raises ValueError if the prompt alone
        does not fit, GrammarError if `params.grammar` does not compile."""
        limit = max_len or self.max_seq_len
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context window is {limit}")
        tokenizer = self.require_tokenizer() if with_text else None
        detok = tokenizer.incremental_decoder(params.skip_special_tokens) if tokenizer else None
        constraint = None if params.grammar is None else self.grammars.constraint(params.grammar)
        return Sequence(list(prompt_ids), params, self.eos_ids, limit, detok, constraint=constraint)

    def _run_to_end(self, seqs: list[Sequence]) -> None:
        for _ in self._run(seqs):
            pass

    def _run(self, seqs: list[Sequence]) -> Iterator[RequestOutput]:
        """Submits `seqs` and steps the scheduler until each has finished, yielding their
        outputs as the steps produce them; `stats` becomes the call's share of the scheduler's
        counts. Raises the error a request ended with (the others are cancelled)."""
        if not seqs:
            return
        if self.scheduler.alive:
            raise RuntimeError(
                "the engine's scheduler runs on another thread (serve): submit requests to it"
            )
        before = self.scheduler.stats()
        self.moe_runtime.reset_stats()  # `experts` over this call's decode steps
        outputs: deque[RequestOutput] = deque()
        requests: list[ScheduledRequest] = []
        unfinished = len(seqs)
        try:
            for seq in seqs:
                requests.append(self.scheduler.submit(seq, outputs.append))
            while unfinished:
                self.scheduler.step()
                while outputs:
                    output = outputs.popleft()
                    if output.error is not None:
                        raise output.error
                    unfinished -= output.finished
                    yield output
        finally:  # also when the caller stops early: the rows are freed by the next step
            for request in requests:
                request.cancel()
            self.stats = self.scheduler.stats().since(before)


def _prefix_cache_for(model: MoeCausalLM, config: EngineConfig) -> EngineConfig:
    """`config`, with the prefix cache off for a model with linear-attention layers: their
    recurrent state after a prefix cannot be restored from cached KV blocks. Asking for one
    (--prefix-cache-tokens > 0) is refused; the default turns it off with a notice."""
    if not model.cfg.has_recurrent_state or config.prefix_cache_tokens == 0:
        return config
    if config.prefix_cache_tokens is not None:
        raise ValueError(
            f"--prefix-cache-tokens {config.prefix_cache_tokens}: {model.cfg.architecture} "
            "keeps a recurrent state per sequence (linear attention), which cached KV blocks "
            "cannot restore; use --prefix-cache-tokens 0"
        )
    log.info("prefix cache off: %s has linear-attention layers", model.cfg.architecture)
    return replace(config, prefix_cache_tokens=0)


def _close_after_failure(runtime: MoeRuntime | None, platform: Platform) -> None:
    """Join the CPU workers and unpin the host banks of a half-built engine; the platform is
    closed even when the runtime's close fails (close() is idempotent)."""
    try:
        if runtime is not None:
            runtime.close()
    finally:
        platform.close()
