"""RoutingTrace: the router's choices at every decode step and MoE layer, saved as .npz.

A trace holds R rows (decoded tokens) x L MoE layers x K routes. Rows of one decode step share
a `step` number; replaying the trace means, for each step in order, each layer in order, one
cache call with that step's rows [T, K] (what the engine's decode does). Prefill never touches
the expert cache, so a trace holds decode steps only.

`record_routes` wraps each layer's expert backend so that its decode records (ids, weights)
before it runs; nothing is recorded, and nothing costs, outside the `with` block.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hybridmoe.layers.moe import OffloadMoELayer
from hybridmoe.moe.backends import ExpertBackend

TRACE_VERSION = 1


@dataclass(frozen=True)
class RoutingTrace:
    expert_ids: np.ndarray  # [R, L, K] int16, the router's expert per route
    weights: np.ndarray  # [R, L, K] float16, the route weights
    step: np.ndarray  # [R] int32, nondecreasing: rows of one decode step share a number
    num_experts: int  # routed experts per MoE layer (E)
    meta: dict = field(default_factory=dict)  # model, target, prompts... (JSON-able)

    def __post_init__(self) -> None:
        ids, w, step = self.expert_ids, self.weights, self.step
        if ids.ndim != 3 or w.shape != ids.shape or step.shape != (ids.shape[0],):
            raise ValueError(
                f"trace shapes disagree: expert_ids {ids.shape} [R, L, K], weights {w.shape}, "
                f"step {step.shape} [R]"
            )
        if ids.size and not (0 <= ids.min() and ids.max() < self.num_experts):
            raise ValueError(f"trace expert ids outside [0, {self.num_experts})")
        if step.size and np.any(np.diff(step) < 0):
            raise ValueError("trace steps must be nondecreasing")

    @property
    def num_rows(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.expert_ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[2]

    def calls(self) -> Iterator[tuple[int, np.ndarray]]:
        """(layer, ids [T, K]) of every cache call in decode order: step by step, layer by layer."""
        bounds = np.flatnonzero(np.diff(self.step)) + 1
        for rows in np.split(np.arange(self.num_rows), bounds):
            if rows.size:
                for layer in range(self.num_layers):
                    yield layer, self.expert_ids[rows[0] : rows[-1] + 1, layer]

    def head(self, rows: int) -> RoutingTrace:
        """The first `rows` rows (a prefix of the decode)."""
        sl = slice(0, rows)
        return RoutingTrace(
            self.expert_ids[sl], self.weights[sl], self.step[sl], self.num_experts, self.meta
        )

    def save(self, path: str | Path) -> None:
        meta = {**self.meta, "version": TRACE_VERSION, "num_experts": self.num_experts}
        np.savez_compressed(
            path,
            expert_ids=self.expert_ids,
            weights=self.weights,
            step=self.step,
            meta=np.array(json.dumps(meta)),
        )

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        """ValueError naming the file when it is no routing trace of this version."""
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                arrays = (data["expert_ids"], data["weights"], data["step"])
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(
                f"{path}: not a routing trace (.npz from `hybridmoe trace`): {exc}"
            ) from exc
        if meta.get("version") != TRACE_VERSION:
            raise ValueError(f"{path}: trace version {meta.get('version')}, need {TRACE_VERSION}")
        num_experts = int(meta.pop("num_experts"))
        meta.pop("version")
        return cls(*arrays, num_experts, meta)


class TraceRecorder:
    """Collects each MoE layer's decode routes; `trace()` assembles them."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_experts = num_experts
        self.ids: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]  # per call [T, K]
        self.weights: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def record(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        # clones stay on their device until trace(): no host sync in the decode loop
        self.ids[layer].append(ids.detach().clone())
        self.weights[layer].append(weights.detach().clone())

    def trace(self, meta: dict | None = None) -> RoutingTrace:
        """The routes recorded so far. ValueError when layers saw different decode calls."""
        calls = {len(c) for c in self.ids}
        if len(calls) > 1:
            raise ValueError(f"MoE layers recorded different numbers of decode calls: {calls}")
        if not self.ids or not self.ids[0]:
            raise ValueError("no decode step was recorded")
        rows = [c.shape[0] for c in self.ids[0]]
        step = np.repeat(np.arange(len(rows), dtype=np.int32), rows)  # [R]
        ids = np.stack([torch.cat(c).cpu().numpy() for c in self.ids], axis=1)  # [R, L, K]
        w = np.stack([torch.cat(c).float().cpu().numpy() for c in self.weights], axis=1)
        return RoutingTrace(
            ids.astype(np.int16), w.astype(np.float16), step, self.num_experts, meta or {}
        )


@dataclass(eq=False)
class RecordingExperts:
    """An expert backend that records decode's routes, then runs the wrapped backend."""

    inner: ExpertBackend
    layer: int
    recorder: TraceRecorder

    def prefill(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.inner.prefill(x, ids, weights)

    def decode(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.recorder.record(self.layer, ids, weights)  # before the cache rewrites ids
        return self.inner.decode(x, ids, weights)


@contextlib.contextmanager
def record_routes(layers: list[OffloadMoELayer], num_experts: int) -> Iterator[TraceRecorder]:
    """Within the block, every decode call of `layers` (the model's MoE layers, whose backends
    a MoE runtime installed) is recorded; the layers' own backends are restored after it."""
    recorder = TraceRecorder(len(layers), num_experts)
    originals = [layer.experts for layer in layers]
    for i, layer in enumerate(layers):
        layer.use(RecordingExperts(originals[i], i, recorder))
    try:
        yield recorder
    finally:
        for layer, backend in zip(layers, originals, strict=True):
            if isinstance(layer.experts, RecordingExperts):  # a closed runtime replaced it
                layer.use(backend)
