"""EngineConfig: how the engine loads and runs a checkpoint. CLI defaults come from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridmoe.moe.config import OffloadConfig

DTYPE_CHOICES = ("auto", "bfloat16", "float32")
# how the dense projections are stored: auto = as loaded (the --dtype); q8_0 / q4_0 quantised
# at load. The output head of q4_0 is q8_0 (llama.cpp's q4_0 files keep it in 6 bits or more).
DENSE_FORMAT_CHOICES = ("auto", "q8_0", "q4_0")
HEAD_FORMATS = {"q8_0": "q8_0", "q4_0": "q8_0"}
DEFAULT_MAX_SEQ_LEN = 4096  # KV positions per sequence when the model's context allows more
PREFIX_BLOCK_TOKENS = 16  # the prefix cache's granularity: prompts share whole blocks of this
# when a host decode step attends by the CPU kernel (kernels/numba_attention.py) instead of
# torch's SDPA: auto = where it gives SDPA's bits, on = always (float32: within SDPA's
# tolerance), off = never (engine/kv_cache.KVCache)
ATTENTION_KERNELS = ("auto", "on", "off")


def check_attention_kernel(value: str) -> None:
    """ValueError naming the choices unless `value` is one of ATTENTION_KERNELS."""
    if value not in ATTENTION_KERNELS:
        raise ValueError(
            f"attention_kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {value!r}"
        )


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"  # auto: bfloat16 for bf16 checkpoints, float32 otherwise
    threads: int | None = None  # torch intra-op threads; None: torch's default
    max_batch: int = 16  # sequences decoded together
    device: str = "auto"  # platform/base.py DEVICE_HELP: auto, cpu, cuda, cuda:N
    # GiB of device memory hybridmoe may use (dense weights, KV cache, expert slots); None:
    # what is free at load on an accelerator, no limit on the cpu device
    gpu_memory: float | None = None
    # KV-cache positions per sequence (prompt + completion), the one source for placement and
    # the server; None: the model's context window, at most DEFAULT_MAX_SEQ_LEN. See
    # resolve_max_seq_len. The cache holds max_batch rows of this many positions (a sliding
    # layer's row: its window, when shorter).
    max_seq_len: int | None = None
    # Prompt tokens whose KV the prefix cache keeps for later requests that share them (engine/
    # prefix_cache.py), rounded up to whole blocks of PREFIX_BLOCK_TOKENS; 0: off; None:
    # max_seq_len tokens (one full context). Beside the KV cache on the device; placement counts
    # it.
    prefix_cache_tokens: int | None = None
    progress: bool = False  # progress bar while loading weights
    # the GGUF to load from --model's directory or cached repo: a file name or a part of one
    # (a quant name such as Q4_K_M); None: --model names the checkpoint itself
    gguf_file: str | None = None
    # attention, dense-MLP and shared-expert projections and the output head stored in this
    # format (DENSE_FORMAT_CHOICES); norms, embeddings and routers always stay as loaded
    dense_format: str = "auto"
    # a host decode step's softmax attention by one numba kernel per layer (kernels/
    # numba_attention.py) instead of torch's SDPA (ATTENTION_KERNELS): auto where the kernel
    # computes SDPA's bits (bfloat16 on a machine whose SDPA it reproduces), so transformers'
    # tokens; on also elsewhere (float32: within SDPA's tolerance, a greedy decode may part
    # from transformers' at a near-tie); off: SDPA
    attention_kernel: str = "auto"
    # a GGUF's whole mapping moved onto anonymous transparent huge pages at load (loader/
    # huge_pages.py), the experts too: 0-10 % less time a CPU decode step, the file's bytes in
    # the process's RSS (without it the cpu device moves only the dense tensors: engine.py)
    huge_pages: bool = False
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # where experts decode

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        check_attention_kernel(self.attention_kernel)
        if self.dense_format not in DENSE_FORMAT_CHOICES:
            raise ValueError(
                f"dense_format must be one of {', '.join(DENSE_FORMAT_CHOICES)}, "
                f"got {self.dense_format!r}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.gpu_memory is not None and not self.gpu_memory > 0:
            raise ValueError(f"gpu_memory must be > 0 GiB, got {self.gpu_memory}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.prefix_cache_tokens is not None and self.prefix_cache_tokens < 0:
            raise ValueError(
                f"prefix_cache_tokens must be >= 0 (0: off), got {self.prefix_cache_tokens}"
            )

    def resolve_max_seq_len(self, context_window: int) -> int:
        """max_seq_len for a model whose context window is `context_window` positions
        (`max_position_embeddings`). Raises ValueError if max_seq_len exceeds it."""
        if self.max_seq_len is None:
            return min(context_window, DEFAULT_MAX_SEQ_LEN)
        if self.max_seq_len > context_window:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} exceeds the model's context window "
                f"({context_window} positions)"
            )
        return self.max_seq_len

    def resolve_prefix_cache_blocks(self, max_seq_len: int) -> int:
        """Blocks of PREFIX_BLOCK_TOKENS the prefix cache holds (0: off), for a KV cache of
        `max_seq_len` positions per row (resolve_max_seq_len)."""
        tokens = max_seq_len if self.prefix_cache_tokens is None else self.prefix_cache_tokens
        return -(-tokens // PREFIX_BLOCK_TOKENS)
