"""OffloadConfig: where MoE experts run at decode time. CLI defaults come from here."""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.moe.backends import DECODE_TARGETS as _TARGETS
from hybridmoe.moe.backends import TARGET_ALIASES, decode_target
from hybridmoe.quant.activation_q8 import ACTIVATION_QUANTS
from hybridmoe.quant.formats import WEIGHT_FORMATS

AUTO_TARGET = "auto"  # resolved when the device is known: engine/placement.py auto_decode_target
DECODE_TARGETS = (AUTO_TARGET, *_TARGETS, *TARGET_ALIASES)  # every name --decode-target accepts
CPU_KERNEL_CHOICES = ("numba", "torch")
# GGUF's names, as registered in quant/formats.py: those a checkpoint's floats can be converted
# to (a k-quant bank comes only from a GGUF file's bytes)
EXPERT_FORMATS = tuple(name for name, fmt in WEIGHT_FORMATS.items() if fmt.can_quantize)
PREFILL_CHOICES = ("auto", "stream", "cpu")  # see moe/prefill.py
DEFAULT_CACHE_RATIO = 0.25
MAX_FETCH_AUTO = "auto"  # max_fetch chosen per layer call (moe/fetch_policy.py AutoFetch)


def parse_max_fetch(text: str) -> int | str:
    """A --max-fetch value: an integer >= 0 or "auto"; ValueError otherwise."""
    if text == MAX_FETCH_AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"max_fetch must be an integer >= 0 or {MAX_FETCH_AUTO!r}, got {text!r}"
        ) from None


@dataclass(frozen=True)
class OffloadConfig:
    # where routed experts run at decode: a name in moe/backends.py's DECODE_TARGETS (an
    # alias such as `gpu` is replaced by its target's name), or `auto`: `cpu` on the cpu
    # device, else `resident` when every expert fits on the accelerator and `hybrid` when not
    decode_target: str = AUTO_TARGET
    # slots in the shared expert cache; None: expert_cache_ratio of all routed experts, or,
    # when neither is given and device memory is planned (engine/placement.py), all that fit
    expert_cache_slots: int | None = None
    expert_cache_ratio: float | None = None  # None: DEFAULT_CACHE_RATIO without a memory plan
    # misses fetched per layer call in hybrid (0 = never fetch); "auto": per call, as many as
    # balance the accelerator's fetch + compute against the CPU's compute (measured online)
    max_fetch: int | str = 1
    overlap: bool = True  # hybrid: CPU experts overlap the accelerator's work
    cpu_threads: int | None = None  # threads of the CPU expert kernel; None: every usable core
    # routed experts' weight format; None: the model's dtype. Quantised formats are made at
    # load from the checkpoint's floats, and every decode target computes with them.
    expert_format: str | None = None
    cpu_kernel: str = "numba"  # CPU expert kernel (moe/cpu_experts.py); torch: the reference
    # host banks page-locked on an accelerator (fast asynchronous fetches); False: pageable,
    # only when asked for (when the system refuses to lock that much memory)
    pin_memory: bool = True
    # where prefill's routed experts run when they are not all resident (moe/prefill.py):
    # stream layer banks to the accelerator, compute on the CPU, or auto (cpu for at most
    # prefill_cpu_tokens tokens, else stream). On the cpu device auto computes from the banks.
    prefill: str = "auto"
    prefill_cpu_tokens: int = 32
    # how expert projections take their input: "q8" (activations quantised per 32-block for
    # q8_0/q4_0, per 256-block for q2_k ... q6_k, integer dot products: quant/activation_q8.py,
    # llama.cpp's arithmetic), "none" (float32 activations, dequantised weights), or "auto"
    # (q8 for a layer whose experts all have integer dots, else none; the dense projections
    # take it too, each by its own format: MoeCausalLM.set_activation_quant); on every decode
    # target and in prefill alike
    activation_quant: str = "auto"

    def __post_init__(self) -> None:
        if self.decode_target not in DECODE_TARGETS:
            raise ValueError(
                f"decode_target must be one of {', '.join(DECODE_TARGETS)}, "
                f"got {self.decode_target!r}"
            )
        if self.decode_target != AUTO_TARGET:
            object.__setattr__(self, "decode_target", decode_target(self.decode_target).name)
        if self.expert_cache_slots is not None and self.expert_cache_slots < 1:
            raise ValueError(f"expert_cache_slots must be >= 1, got {self.expert_cache_slots}")
        if self.expert_cache_ratio is not None and not 0.0 < self.expert_cache_ratio <= 1.0:
            raise ValueError(f"expert_cache_ratio must be in (0, 1], got {self.expert_cache_ratio}")
        if isinstance(self.max_fetch, str) and self.max_fetch != MAX_FETCH_AUTO:
            raise ValueError(
                f"max_fetch must be an integer >= 0 or {MAX_FETCH_AUTO!r}, got {self.max_fetch!r}"
            )
        if isinstance(self.max_fetch, int) and self.max_fetch < 0:
            raise ValueError(f"max_fetch must be >= 0, got {self.max_fetch}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.cpu_kernel not in CPU_KERNEL_CHOICES:
            raise ValueError(
                f"cpu_kernel must be one of {', '.join(CPU_KERNEL_CHOICES)}, "
                f"got {self.cpu_kernel!r}"
            )
        if self.prefill not in PREFILL_CHOICES:
            raise ValueError(
                f"prefill must be one of {', '.join(PREFILL_CHOICES)}, got {self.prefill!r}"
            )
        if self.prefill_cpu_tokens < 0:
            raise ValueError(f"prefill_cpu_tokens must be >= 0, got {self.prefill_cpu_tokens}")
        if self.activation_quant not in ACTIVATION_QUANTS:
            raise ValueError(
                f"activation_quant must be one of {', '.join(ACTIVATION_QUANTS)}, "
                f"got {self.activation_quant!r}"
            )
        if self.expert_format in WEIGHT_FORMATS and self.expert_format not in EXPERT_FORMATS:
            raise ValueError(
                f"expert_format {self.expert_format!r} has no quantiser: its experts come only "
                f"from a GGUF file; convert to one of {', '.join(EXPERT_FORMATS)}"
            )
        if self.expert_format is not None and self.expert_format not in EXPERT_FORMATS:
            raise ValueError(
                f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, "
                f"got {self.expert_format!r}"
            )

    def num_slots(self, total_experts: int) -> int:
        """Slots for a model with `total_experts` routed experts over all MoE layers."""
        if self.expert_cache_slots is not None:
            return self.expert_cache_slots
        return max(1, round((self.expert_cache_ratio or DEFAULT_CACHE_RATIO) * total_experts))

    @property
    def cache_size_given(self) -> bool:
        return self.expert_cache_slots is not None or self.expert_cache_ratio is not None
