"""MoeCausalLM: the decoder-only transformer the supported families are built with (their
ModelFamily's `build`), from the family's attention (full and linear), norm, router and
shared-expert kinds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.config.model import ModelConfig
from hybridmoe.kernels.head_block import decode_head
from hybridmoe.kernels.projection import DenseProjection
from hybridmoe.layers.attention import create_attention
from hybridmoe.layers.batch import ForwardBatch, KVStore, build_attention_masks
from hybridmoe.layers.linear import GatedMLP, stored_projection
from hybridmoe.layers.moe import OffloadMoELayer
from hybridmoe.layers.norm import NORMS
from hybridmoe.layers.rotary import RotaryEmbedding
from hybridmoe.loader.weights import WeightSource
from hybridmoe.models.registry import ModelFamily
from hybridmoe.platform.base import to_device_no_sync
from hybridmoe.quant.formats import WeightFormat

# the block offers a decoder layer keeps, one a batch size (the attention block keeps
# kernels/attention_block.MAX_PLANS plans a layer, made of them)
MAX_OFFERS = 4


class DecoderLayer:
    def __init__(
        self, cfg: ModelConfig, family: ModelFamily, idx: int, source: WeightSource, moe_idx: int
    ):
        prefix = f"{family.weights.model_prefix}.layers.{idx}"
        hidden = cfg.hidden_size
        self.eps, self.norm_kind = cfg.rms_norm_eps, NORMS[family.norm]
        self.input_norm = self.norm_kind.prepare(
            source.get(f"{prefix}.input_layernorm.weight", (hidden,))
        )
        post_norm_name = f"{prefix}.post_attention_layernorm.weight"
        self.post_attention_norm = self.norm_kind.prepare(source.get(post_norm_name, (hidden,)))
        if cfg.is_linear(idx):
            kind, attn_prefix = family.linear_attention, f"{prefix}.linear_attn"
        else:
            kind, attn_prefix = family.attention, f"{prefix}.self_attn"
        self.attn = create_attention(kind, cfg, idx, source, attn_prefix)
        if cfg.sparse_layers[idx]:
            self.mlp = OffloadMoELayer.load(
                cfg,
                source,
                f"{prefix}.{family.weights.moe_prefix}",
                family.weights.expert_names,
                moe_idx,
                router_kind=family.router,
                shared_expert_kind=family.shared_expert,
                router_name=family.weights.router,
                experts_loader=family.weights.experts_loader,
            )
        else:
            self.mlp = GatedMLP.load(source, f"{prefix}.mlp", hidden, cfg.intermediate_size)
        self._offers: dict[tuple, tuple] = {}  # _block_offers' answers by their key

    def to(self, device: torch.device) -> None:
        """Moves the dense weights (routed experts stay where the MoE runtime put them)."""
        self.input_norm = self.input_norm.to(device)
        self.post_attention_norm = self.post_attention_norm.to(device)
        self.attn.to(device)
        self.mlp.to(device)

    def projections(self) -> list[DenseProjection]:
        """The layer's quantisable projections: attention's, the dense MLP's or the shared
        expert's (not the router)."""
        return self.attn.projections() + self.mlp.projections()

    def _residual_block(
        self, x: torch.Tensor, batch: ForwardBatch, delta: torch.Tensor | None
    ) -> tuple | None:
        """The norms, attention and residual adds below in one kernel call where the attention
        offers it (GroupedQueryAttention.decode_residual_block: a host decode step) and the
        norms are plain RMSNorms with the attention's epsilon, and in the same call an MoE
        layer's routing where its router offers it (block_route) and its routed experts where
        its backend does (OffloadMoELayer.block_experts): (stream, normed, routes or None, the
        experts' partial or None); None otherwise."""
        block = getattr(self.attn, "decode_residual_block", None)
        if block is None or self.norm_kind is not NORMS["rms"] or not batch.is_decode:
            return None
        if self.eps != self.attn.cfg.rms_norm_eps:
            return None
        route, experts = self._block_offers(x)
        return block(x, delta, self.input_norm, self.post_attention_norm, batch, route, experts)

    def _block_offers(self, x: torch.Tensor) -> tuple[tuple | None, tuple | None]:
        """(the router's block_route, the MoE layer's block_experts) for a step on x, or None
        each: asked once for the step's dtype, rows and device and the layer's router and
        backend, then kept (a decode step asks per layer; both answers depend on nothing
        else), the same objects for every step of that key (the attention block's plans,
        kept per batch size, are made of them: kernels/attention_block._Plan)."""
        mlp = self.mlp
        if not isinstance(mlp, OffloadMoELayer):
            return None, None
        key = (x.dtype, x.shape[0], x.device, mlp.router, mlp.experts)
        offers = self._offers.get(key)
        if offers is None:
            block_route = getattr(mlp.router, "block_route", None)
            route = None if block_route is None else block_route(x.dtype)
            experts = None if route is None else mlp.block_experts(x, route[1], route[3])
            if len(self._offers) >= MAX_OFFERS:  # the oldest goes, as the block's plans do
                del self._offers[next(iter(self._offers))]
            offers = self._offers[key] = route, experts
        return offers

    def __call__(
        self, x: torch.Tensor, batch: ForwardBatch, delta: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the residual stream x + delta [B, T, H] (delta: the previous layer's
        MLP output, None before the first layer) -> (the stream after attention, this layer's
        MLP output), whose sum is the layer's output: each residual add is fused with the
        norm after it (`norm_kind.add_apply`), the last one with the next layer's. An MoE
        layer's output may be its float32 partial: add_apply rounds it to x's dtype first."""
        fused, routes, partial = self._residual_block(x, batch, delta), None, None
        if fused is not None:
            x, h, routes, partial = fused
        else:
            if delta is None:
                h = self.norm_kind.apply(x, self.input_norm, self.eps)
            else:
                x, h = self.norm_kind.add_apply(x, delta, self.input_norm, self.eps)
            attn_out = self.attn(h, batch)
            x, h = self.norm_kind.add_apply(x, attn_out, self.post_attention_norm, self.eps)
        if isinstance(self.mlp, OffloadMoELayer):
            return x, self.mlp(h, batch.is_decode, rounded=False, routes=routes, partial=partial)
        return x, self.mlp(h)


class MoeCausalLM:
    def __init__(self, cfg: ModelConfig, family: ModelFamily, source: WeightSource):
        self.cfg = cfg
        self.dtype = source.dtype
        embed_shape = (cfg.vocab_size, cfg.hidden_size)
        prefix = family.weights.model_prefix
        self.embed = source.get(f"{prefix}.embed_tokens.weight", embed_shape)
        moe_idx = [sum(cfg.sparse_layers[:i]) for i in range(cfg.num_layers)]  # MoE ordinal
        self.layers = [
            DecoderLayer(cfg, family, i, source, moe_idx[i]) for i in range(cfg.num_layers)
        ]
        self.norm_kind = NORMS[family.norm]
        self.norm = self.norm_kind.prepare(source.get(f"{prefix}.norm.weight", (cfg.hidden_size,)))
        self.lm_head = self._lm_head(cfg, source)  # [V, H]
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)
        self.device = torch.device("cpu")
        # every window some layer attends within (None: full attention), for make_batch
        self._windows = frozenset(cfg.layer_window(i) for i in range(cfg.num_layers))
        self._head_plans: dict[tuple, object] = {}  # kernels/head_block.decode_head's

    def _lm_head(self, cfg: ModelConfig, source: WeightSource) -> DenseProjection:
        """The output projection [V, H], as transformers picks it: under tie_word_embeddings the
        embeddings, unless the checkpoint stores an lm_head.weight that differs from them
        (transformers then unties); otherwise lm_head.weight, which must be present (in a
        GGUF file's quantised type where it has one: stored_projection)."""
        tied, shape = cfg.tie_word_embeddings, (cfg.vocab_size, cfg.hidden_size)
        if tied and not source.has("lm_head.weight"):
            return DenseProjection(self.embed)
        found = None if tied else stored_projection(source, "lm_head.weight", *shape)
        if found is not None:
            return DenseProjection(found[0], None, found[1], cfg.hidden_size)
        head = source.get("lm_head.weight", shape)
        return DenseProjection(self.embed if tied and torch.equal(head, self.embed) else head)

    def to(self, device: torch.device) -> None:
        """Moves every dense weight to `device`: embeddings, attention, norms, dense MLPs,
        routers and shared experts. Routed experts are the MoE runtime's (engine/moe_runtime)."""
        tied = self.lm_head.weight is self.embed
        self.embed = self.embed.to(device)
        if tied:
            self.lm_head = DenseProjection(self.embed)
        else:
            self.lm_head.to(device)
        self.norm = self.norm.to(device)
        self.rotary.to(device)
        for layer in self.layers:
            layer.to(device)
        self.device = torch.device(device)

    def dense_nbytes(self) -> int:
        """Bytes of every weight to() moves (the tied head counted once)."""
        found = [self.embed, *self.lm_head.tensors(), self.norm]
        for layer in self.layers:
            found += [layer.input_norm, layer.post_attention_norm]
            found += layer.attn.dense_tensors() + layer.mlp.dense_tensors()
        return sum(t.nbytes for t in {id(t): t for t in found}.values())

    def set_activation_quant(self, activation_quant: str) -> None:
        """The dense projections' arithmetic (DenseProjection.set_activation_quant: "auto" and
        "q8" take q8 activations wherever a projection's format has integer dot products, as
        the routed experts do under the same --activation-quant; routers stay float)."""
        for layer in self.layers:
            for projection in layer.projections():
                projection.set_activation_quant(activation_quant)
        self.lm_head.set_activation_quant(activation_quant)

    def quantize_dense(self, fmt: WeightFormat, head_fmt: WeightFormat) -> None:
        """Store the dense projections in `fmt` (attention, dense MLPs, shared experts) and the
        output head in `head_fmt`, quantised from the loaded values (call before to()). Norms,
        embeddings, routers and the shared-expert gate stay as loaded. A tied head gets its
        own quantised copy; the embeddings stay. ValueError if a row is not whole blocks."""
        for layer in self.layers:
            for projection in layer.projections():
                projection.quantize(fmt, self.dtype)
        head = self.lm_head  # never shares a tied head's object
        self.lm_head = DenseProjection(head.weight, None, head.fmt, head.in_features)
        self.lm_head.quantize(head_fmt, self.dtype)

    @property
    def moe_layers(self) -> list[OffloadMoELayer]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, OffloadMoELayer)]

    def make_batch(
        self,
        positions: torch.Tensor,
        rows: list[int],
        kv: KVStore | None,
        is_decode: bool = False,
        starts: tuple[int, ...] | None = None,
    ) -> ForwardBatch:
        """The step's shared facts for host `positions` [B, T] and KV-cache `rows`; what the
        device needs is copied there without the host waiting (docs/host-syncs.md).
        `starts`: each row's first position as ints, where the caller made `positions` from
        them (a decode step: T = 1), so they are not read back from the tensor."""
        if starts is None or positions.shape[1] != 1:
            kv_len = int(positions.max()) + 1  # read on the host, before the copy
            starts = tuple(positions[:, 0].tolist())
        else:
            kv_len = max(starts) + 1
        positions = to_device_no_sync(positions, self.device)
        windows = self._windows
        rings = frozenset() if kv is None else kv.ring_windows
        masks = build_attention_masks(positions, kv_len, windows, rings, starts)
        if is_decode:  # a decode step's rows of the tables (the same bits)
            cos, sin = self.rotary.table_cos_sin(positions, self.dtype, kv_len, starts)
        else:
            cos, sin = self.rotary.cos_sin(positions, self.dtype)
        row_index = to_device_no_sync(torch.tensor(rows), self.device)
        return ForwardBatch(
            positions, rows, row_index, kv_len, masks, cos, sin, kv, is_decode, starts
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, last_only: bool = True
    ) -> torch.Tensor:
        """input_ids [B, T] -> float32 logits [B, V] (last token) or [B, T, V], in host
        memory (where sampling runs)."""
        x = F.embedding(to_device_no_sync(input_ids, self.device), self.embed)  # [B, T, H]
        delta = None
        for layer in self.layers:
            x, delta = layer(x, batch, delta)  # the stream is x + delta
        eps = self.cfg.rms_norm_eps
        if last_only and x.shape[1] == 1 and self.norm_kind is NORMS["rms"]:
            logits = decode_head(x, delta, self.norm, eps, self.lm_head, self._head_plans)
            if logits is not None:  # the norm and head below in one host kernel call
                return logits
        if last_only:
            x, delta = x[:, -1].contiguous(), delta[:, -1].contiguous()
        _, x = self.norm_kind.add_apply(x, delta, self.norm, eps)
        logits = self.lm_head(x).float()  # [B, (T,) V]
        return logits if logits.is_cpu else logits.cpu()  # the one sync sampling needs

    def logits(self, input_ids: list[int]) -> torch.Tensor:
        """[T, V] float32 logits of a fresh sequence; no state is kept."""
        ids = torch.tensor([input_ids])
        batch = self.make_batch(torch.arange(len(input_ids))[None], [0], kv=None)
        return self.forward(ids, batch, last_only=False)[0]
