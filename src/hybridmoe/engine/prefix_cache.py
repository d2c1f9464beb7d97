"""PrefixCache: requests whose prompts share a prefix (a system prompt, a chat history, an
agent's tool list) reuse its KV instead of recomputing it.

A tree over prompt tokens in blocks of PREFIX_BLOCK_TOKENS: a node is one block of token ids
under the blocks before it and owns one block of a KVBlockPool, that block's keys and values.
At admission the longest cached prefix of whole blocks is copied into the request's KV row and
only the rest of the prompt is prefilled (at least its last token, whose logits give the first
sampled token); after the prefill, the prompt's whole blocks that were not cached yet are copied
from the row into free pool blocks. When none is free, the least recently used leaf is evicted:
a block is reachable only through the blocks before it, so evicting leaves first never strands
one, and a node is never less recently used than its children.

Copying instead of sharing keeps the decode path as it is: a row stays one contiguous tensor,
read by attention as a view; with rows as block tables, every decode step would gather its keys.

Only prompt tokens are cached, never generated ones: their KV was computed by decode steps,
one token at a time on the decode target, which round differently from a prefill of the same
tokens (and a chat's next turn re-renders the reply through the chat template anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridmoe.config.model import ModelConfig
from hybridmoe.engine.config import PREFIX_BLOCK_TOKENS
from hybridmoe.engine.kv_cache import KVBlockPool, KVCache


@dataclass(frozen=True)
class PrefixCacheStats:
    blocks_total: int
    blocks_used: int  # holding a cached prompt block
    hit_tokens: int  # prompt positions whose KV was copied instead of prefilled, since start
    queried_tokens: int  # prompt tokens looked up, since start

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class _Node:
    __slots__ = ("tokens", "parent", "children", "block", "last_used")

    def __init__(self, tokens: tuple[int, ...], parent: _Node | None, block: int, last_used: int):
        self.tokens, self.parent, self.block, self.last_used = tokens, parent, block, last_used
        self.children: dict[tuple[int, ...], _Node] = {}


class PrefixTree:
    """Which pool block holds which prompt block: bookkeeping only, no tensors. Not thread-safe
    (the scheduler thread owns it)."""

    def __init__(self, num_blocks: int, block_tokens: int):
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        self.root = _Node((), None, -1, 0)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ones first
        self._leaves: set[_Node] = set()  # nodes without children, the eviction candidates
        self._clock = 0  # advanced by every match: a node's last_used is when it last matched

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def match(self, ids: Sequence[int], max_blocks: int) -> list[_Node]:
        """The nodes of the longest cached prefix of `ids`, at most `max_blocks` blocks, root
        side first; marks them used now."""
        self._clock += 1
        path, node = [], self.root
        for key in self._keys(ids, max_blocks):
            node = node.children.get(key)
            if node is None:
                break
            node.last_used = self._clock
            path.append(node)
        return path

    def insert(self, ids: Sequence[int], num_blocks: int) -> tuple[int, list[_Node]]:
        """Adds the first `num_blocks` blocks of `ids`: (the index of the first block that was
        not cached, the new nodes), whose pool blocks the caller fills. Evicts least recently
        used leaves off this prefix for room, and stops early when none is left (a pool
        smaller than the prompt)."""
        path = self.match(ids, num_blocks)
        first = len(path)
        node, new, protected = (path[-1] if path else self.root), [], set(path)
        for key in self._keys(ids, num_blocks)[first:]:
            block = self._take_block(protected)
            if block is None:
                break
            child = _Node(key, node, block, self._clock)
            node.children[key] = child
            self._leaves.discard(node)
            self._leaves.add(child)
            new.append(child)
            protected.add(child)
            node = child
        return first, new

    def remove(self, nodes: list[_Node]) -> None:
        """Drops `nodes`, a chain that insert just returned, and frees their blocks."""
        for node in reversed(nodes):
            self._drop(node)

    def check(self) -> None:
        """RuntimeError unless every block is either free or owned by exactly one node, and
        the leaf set is the tree's leaves (for tests)."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        owned = sorted([n.block for n in nodes] + self.free_blocks)
        leaves = {n for n in nodes if not n.children}
        if owned != list(range(self.num_blocks)) or leaves != self._leaves:
            raise RuntimeError(
                f"prefix tree inconsistent: {len(nodes)} nodes + {len(self.free_blocks)} free "
                f"blocks for {self.num_blocks}; {len(leaves)} leaves, {len(self._leaves)} listed"
            )

    def _keys(self, ids: Sequence[int], num_blocks: int) -> list[tuple[int, ...]]:
        size = self.block_tokens
        return [tuple(ids[i * size : (i + 1) * size]) for i in range(num_blocks)]

    def _take_block(self, protected: set[_Node]) -> int | None:
        if not self.free_blocks:
            candidates = self._leaves - protected
            if not candidates:
                return None
            self._drop(min(candidates, key=lambda n: n.last_used))
        return self.free_blocks.pop()

    def _drop(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[node.tokens]
        self._leaves.discard(node)
        self.free_blocks.append(node.block)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)


class PrefixCache:
    """The tree and the pool of `num_blocks` blocks its nodes own, beside one KVCache."""

    def __init__(
        self, cfg: ModelConfig, num_blocks: int, dtype: torch.dtype, device: torch.device | str
    ):
        self.pool = KVBlockPool(cfg, num_blocks, PREFIX_BLOCK_TOKENS, dtype, device)
        self.tree = PrefixTree(num_blocks, PREFIX_BLOCK_TOKENS)
        self.hit_tokens = self.queried_tokens = 0

    def load(self, prompt_ids: Sequence[int], row: int, cache: KVCache) -> int:
        """Copies the longest cached prefix of `prompt_ids` into `row` of `cache`; returns how
        many of the prompt's first positions the row now holds, at most len(prompt_ids) - 1
        (the last token is always prefilled, for its logits)."""
        nodes = self.tree.match(prompt_ids, len(prompt_ids) // PREFIX_BLOCK_TOKENS)
        if nodes:
            self.pool.load_row(cache, row, [node.block for node in nodes])
        cached = min(len(nodes) * PREFIX_BLOCK_TOKENS, len(prompt_ids) - 1)
        self.queried_tokens += len(prompt_ids)
        self.hit_tokens += cached
        return cached

    def store(self, prompt_ids: Sequence[int], row: int, cache: KVCache) -> None:
        """Caches the whole blocks of `prompt_ids` that are not cached yet, from `row` of
        `cache`, which holds the prompt's KV (after its prefill). On failure the tree is as
        before, less what was evicted."""
        first, new = self.tree.insert(prompt_ids, len(prompt_ids) // PREFIX_BLOCK_TOKENS)
        if not new:
            return
        try:
            self.pool.store_row(cache, row, first, [node.block for node in new])
        except BaseException:
            self.tree.remove(new)
            raise

    def stats(self) -> PrefixCacheStats:
        tree = self.tree
        return PrefixCacheStats(
            tree.num_blocks, tree.blocks_used, self.hit_tokens, self.queried_tokens
        )
