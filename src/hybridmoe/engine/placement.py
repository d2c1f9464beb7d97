"""Device memory planning: how many expert slots fit beside the dense weights and KV cache.

The budget is `--gpu-memory` GiB when given, else the accelerator's free memory at load; on
the cpu device without `--gpu-memory` nothing is planned (host memory is the tier and the
slot count comes from OffloadConfig alone) beyond checking that the KV cache fits in the
host's available memory. Besides a fixed reserve for activations, the plan
sets aside the peak of the decode expert kernel's temporaries at `max_batch` tokens (for
q8_0/q4_0 it expands a chunk of gathered experts to float32: a GiB or more). What does not
fit is refused with the figures.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hybridmoe.engine.config import PREFIX_BLOCK_TOKENS, EngineConfig
from hybridmoe.engine.kv_cache import KVBlockPool, KVCache
from hybridmoe.errors import DeviceMemoryError, HostMemoryError
from hybridmoe.kernels.torch_moe import gathered_moe_peak_bytes
from hybridmoe.models.transformer import MoeCausalLM
from hybridmoe.moe.backends import ResidentExperts
from hybridmoe.moe.config import AUTO_TARGET, OffloadConfig
from hybridmoe.platform.base import Platform
from hybridmoe.platform.cpu import host_available_bytes
from hybridmoe.quant.bank import ExpertBank
from hybridmoe.quant.expert_math import ExpertBiases
from hybridmoe.quant.formats import WeightFormat, dense_format, weight_format

GIB = 2**30
# Activations, logits and allocator slack (the expert kernel's temporaries are counted apart).
ACTIVATION_RESERVE_BYTES = GIB // 2


@dataclass(frozen=True)
class DeviceMemoryPlan:
    budget_bytes: int
    dense_bytes: int
    kv_bytes: int
    expert_kernel_bytes: int = 0  # peak temporaries of one decode step's expert kernel call
    activation_bytes: int = ACTIVATION_RESERVE_BYTES
    prefix_cache_bytes: int = 0  # the prefix cache's KV blocks (--prefix-cache-tokens)

    @property
    def reserve_bytes(self) -> int:
        """What is set aside for the step's temporaries."""
        return self.activation_bytes + self.expert_kernel_bytes

    @property
    def expert_bytes(self) -> int:
        """What is left for expert slots (and prefill's layer buffers)."""
        kv_bytes = self.kv_bytes + self.prefix_cache_bytes
        return self.budget_bytes - self.dense_bytes - kv_bytes - self.reserve_bytes

    def describe(self) -> str:
        return (
            f"budget {self.budget_bytes / GIB:.2f} GiB = dense weights "
            f"{self.dense_bytes / GIB:.2f} GiB + KV cache {self.kv_bytes / GIB:.2f} GiB + "
            f"prefix cache {self.prefix_cache_bytes / GIB:.2f} GiB + "
            f"reserve {self.reserve_bytes / GIB:.2f} GiB (activations "
            f"{self.activation_bytes / GIB:.2f} + expert kernel "
            f"{self.expert_kernel_bytes / GIB:.2f}) + experts "
            f"{self.expert_bytes / GIB:.2f} GiB"
        )

    def check_all_experts_fit(self, experts_nbytes: int, total: int) -> None:
        """DeviceMemoryError naming the flags unless all `total` experts, `experts_nbytes`
        together, fit (the `resident` target keeps every expert on the device)."""
        if experts_nbytes > self.expert_bytes:
            raise DeviceMemoryError(
                f"decode target 'resident' keeps all {total} experts on the device "
                f"({experts_nbytes / GIB:.2f} GiB) but they do not fit: {self.describe()}; "
                "use --decode-target hybrid (or offload), or raise --gpu-memory"
            )

    def slots(self, needed_bytes: int, expert_nbytes: int, total: int, asked: int | None) -> int:
        """Expert slots that fit once `needed_bytes` (prefill buffers) are set aside: `asked`
        when given and it fits, else as many as fit, at most `total`. DeviceMemoryError
        naming the flags when nothing (or not `asked`) fits."""
        fit = max(0, (self.expert_bytes - needed_bytes) // expert_nbytes)
        if asked is not None and asked > fit:
            raise DeviceMemoryError(
                f"an expert cache of {asked} slots (--expert-cache-slots/--expert-cache-ratio) "
                f"needs {asked * expert_nbytes / GIB:.2f} GiB but {fit} slots fit "
                f"({self.describe()}); ask for fewer, or raise --gpu-memory"
            )
        if fit < 1:
            raise DeviceMemoryError(
                f"no expert slot fits on the device ({self.describe()}, prefill buffers "
                f"{needed_bytes / GIB:.2f} GiB); lower --max-batch or --max-seq-len, use "
                "--prefill cpu, or raise --gpu-memory"
            )
        return asked if asked is not None else min(total, fit)


def plan_device_memory(
    model: MoeCausalLM, config: EngineConfig, platform: Platform
) -> DeviceMemoryPlan | None:
    """The plan for `model` on `platform`, or None when nothing is to be planned."""
    seq_len = config.resolve_max_seq_len(model.cfg.max_position_embeddings)
    kv_bytes = KVCache.nbytes(model.cfg, config.max_batch, seq_len, model.dtype)
    if config.gpu_memory is not None:
        budget = int(config.gpu_memory * GIB)
    else:
        memory = platform.memory_bytes()
        if memory is None:
            check_host_kv_cache(kv_bytes, config.max_batch, seq_len)
            return None
        budget = memory[0]  # free now: the dense weights are still in host memory
    kernel_bytes = expert_kernel_bytes(model, config.offload, config.max_batch)
    blocks = config.resolve_prefix_cache_blocks(seq_len)
    prefix_bytes = KVBlockPool.nbytes(model.cfg, blocks, PREFIX_BLOCK_TOKENS, model.dtype)
    plan = DeviceMemoryPlan(
        budget, model.dense_nbytes(), kv_bytes, kernel_bytes, prefix_cache_bytes=prefix_bytes
    )
    if plan.expert_bytes < 0:
        raise DeviceMemoryError(
            f"the model does not fit on the device even without experts: {plan.describe()}; "
            "lower --max-batch, --max-seq-len or --prefix-cache-tokens, or raise --gpu-memory"
        )
    return plan


def check_host_kv_cache(kv_bytes: int, max_batch: int, max_seq_len: int) -> None:
    """HostMemoryError naming the flags when a KV cache of `kv_bytes` (max_batch rows of
    max_seq_len positions) is larger than the host memory available now: refused with the
    figures before anything is allocated, not by the allocator."""
    available = host_available_bytes()
    if kv_bytes > available:
        raise HostMemoryError(
            f"the KV cache of --max-batch {max_batch} requests x --max-seq-len {max_seq_len} "
            f"positions needs {kv_bytes / GIB:.2f} GiB, but the host has "
            f"{available / GIB:.2f} GiB available; lower --max-batch or --max-seq-len"
        )


def expert_kernel_bytes(model: MoeCausalLM, offload: OffloadConfig, max_batch: int) -> int:
    """Peak device bytes of the temporaries of one decode expert kernel call over `max_batch`
    tokens: gathered_moe's. Larger batches take the grouped reference, whose peak (one expert
    expanded at a time) is below it. Zero for the `cpu` target: its experts never run on the
    device."""
    if offload.decode_target == "cpu" or not model.moe_layers:
        return 0
    return max(
        gathered_moe_peak_bytes(bank, max_batch, model.cfg.top_k, model.dtype)
        for bank in expert_shape_banks(model, offload)
    )


def expert_shape_banks(model: MoeCausalLM, offload: OffloadConfig) -> list[ExpertBank]:
    """One expert of each MoE layer's bank as create_moe_runtime builds it (its formats and
    shapes), on the meta device: what the expert kernel's temporaries and the slots depend on,
    without memory."""
    cfg = model.cfg
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    biases = None
    if cfg.expert_bias:  # kept in the model's dtype beside any format (quant/expert_math.py)
        biases = ExpertBiases(
            torch.empty((1, 2 * inter), dtype=model.dtype, device="meta"),
            torch.empty((1, hidden), dtype=model.dtype, device="meta"),
        )
    banks = []
    for formats in _layer_formats(model, offload):
        gate_up_fmt, down_fmt = formats
        gate_up_fmt.check_row_length(hidden, "hidden_size (gate/up rows)")
        down_fmt.check_row_length(inter, "moe_intermediate_size (down rows)")
        gate_up = ExpertBank.empty_like_tensor(gate_up_fmt, (1, 2 * inter, hidden), "meta")
        down = ExpertBank.empty_like_tensor(down_fmt, (1, hidden, inter), "meta")
        banks.append(ExpertBank(gate_up, down, gate_up_fmt, down_fmt=down_fmt, biases=biases))
    return banks


def resolve_decode_target(
    model: MoeCausalLM, config: EngineConfig, platform: Platform
) -> EngineConfig:
    """`config` with decode target `auto` replaced by the target it means on `platform`: `cpu`
    on the cpu device (the fused CPU kernel; torch's gather + bmm path is slower there and
    its thread pool collapses when the cores are shared); on an accelerator `resident` when
    every expert fits beside the dense weights and the KV cache (the memory plan of
    `resident`), else `hybrid`. Any other target is returned as it is."""
    offload = config.offload
    if offload.decode_target != AUTO_TARGET:
        return config

    def choosing(target: str) -> EngineConfig:
        return replace(config, offload=replace(offload, decode_target=target))

    if platform.device.type == "cpu" or not model.moe_layers:
        return choosing("cpu")
    resident = choosing("resident")
    memory = plan_device_memory(model, resident, platform)
    banks = expert_shape_banks(model, resident.offload)
    experts_nbytes = model.cfg.num_experts * sum(bank.expert_nbytes for bank in banks)
    fits = memory is None or memory.expert_bytes >= experts_nbytes
    return resident if fits else choosing("hybrid")


def _layer_formats(
    model: MoeCausalLM, offload: OffloadConfig
) -> list[tuple[WeightFormat, WeightFormat]]:
    """Each MoE layer's (gate_up, down) formats as create_moe_runtime keeps them: a file's own
    (GGUF; --expert-format converts only dense files' experts), else `expert_format`, else the
    model's dtype."""
    asked = weight_format(offload.expert_format) if offload.expert_format else None
    formats = []
    for layer in model.moe_layers:
        experts = layer.experts
        store = experts.store if isinstance(experts, ResidentExperts) else None
        if isinstance(store, ExpertBank) and (asked is None or store.is_quantized):
            formats.append(store.formats)
        else:
            fmt = asked or dense_format(model.dtype)
            formats.append((fmt, fmt))
    return formats
