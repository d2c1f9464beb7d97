"""Prefix cache: the tree's bookkeeping and LRU eviction alone, then end to end against the same
engine without it. Greedy tokens are identical with and without the cache for every decode
target, in float32 and bfloat16, on the demo model and a transformers-made checkpoint: a second
request sharing a long prefix, a request whose whole prompt is cached, requests sharing
prefixes batched, and eviction under a tiny pool; the reused lengths are exactly the block
arithmetic's; a request that fails or is cancelled leaves the tree consistent."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hf_checkpoints import write_hf_checkpoint
from hybridmoe.engine import Engine, EngineConfig, SamplingParams, steps
from hybridmoe.engine.config import PREFIX_BLOCK_TOKENS as BLOCK
from hybridmoe.engine.kv_cache import KVCache
from hybridmoe.engine.prefix_cache import PrefixCache, PrefixTree
from hybridmoe.moe.config import OffloadConfig

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
TARGETS = {
    "resident": OffloadConfig(decode_target="resident"),
    "offload": OffloadConfig(decode_target="offload", expert_cache_slots=4),
    "cpu": OffloadConfig(decode_target="cpu"),
    "hybrid": OffloadConfig(decode_target="hybrid", expert_cache_slots=4, max_fetch=1),
}
TINY_POOL_TOKENS = 2 * BLOCK


# --- the tree alone ------------------------------------------------------------------------


def blocks(*firsts: int) -> list[int]:
    """A prompt of whole blocks, block i made of BLOCK copies of firsts[i]."""
    return [t for first in firsts for t in [first] * BLOCK]


def test_match_finds_the_longest_cached_prefix_of_whole_blocks():
    tree = PrefixTree(8, BLOCK)
    first, new = tree.insert(blocks(1, 2, 3), 3)
    assert (first, len(new)) == (0, 3)
    assert [n.block for n in tree.match(blocks(1, 2, 9), 3)] == [new[0].block, new[1].block]
    assert tree.match(blocks(1, 2, 3), 2) == new[:2], "at most max_blocks"
    assert tree.match(blocks(5, 2, 3), 3) == [], "a block matches only under the same parents"
    first, more = tree.insert(blocks(1, 2, 4, 5), 4)
    assert (first, len(more), tree.blocks_used) == (2, 2, 5)
    tree.check()


def test_a_full_pool_evicts_the_least_recently_used_leaf():
    tree = PrefixTree(3, BLOCK)
    for first in (1, 2, 3):
        tree.insert(blocks(first), 1)
    tree.match(blocks(1), 1)  # 1 is now more recent than 2
    tree.insert(blocks(4), 1)
    assert [len(tree.match(blocks(f), 1)) for f in (1, 2, 3, 4)] == [1, 0, 1, 1]
    tree.check()


def test_eviction_takes_leaves_first_and_never_the_prefix_being_inserted():
    tree = PrefixTree(3, BLOCK)
    tree.insert(blocks(1, 2, 3), 3)
    first, new = tree.insert(blocks(1, 2, 7, 8), 4)  # room for one: 3 goes, 1 and 2 stay
    assert (first, len(new)) == (2, 1)
    assert len(tree.match(blocks(1, 2, 7), 3)) == 3 and tree.blocks_used == 3
    assert tree.insert(blocks(5, 6, 7, 8), 4)[1] != [], "the old chain is evicted leaf-first"
    assert len(tree.match(blocks(5, 6, 7), 3)) == 3 and tree.match(blocks(1), 1) == []
    tree.check()


def test_remove_undoes_an_insert():
    tree = PrefixTree(4, BLOCK)
    tree.insert(blocks(1), 1)
    _, new = tree.insert(blocks(1, 2, 3), 3)
    tree.remove(new)
    assert tree.blocks_used == 1 and len(tree.match(blocks(1, 2), 2)) == 1
    tree.check()


# --- the suffix prefill against the full prefill (its reference) ------------------------------


def prefill_logits(model, ids: list[int], start: int, row: int, cache: KVCache) -> torch.Tensor:
    """[V] logits of the last token after prefilling ids[start:] at positions start.. of `row`."""
    positions = torch.arange(start, len(ids))[None]  # [1, T - start]
    batch = model.make_batch(positions, [row], cache)
    return model.forward(torch.tensor([ids[start:]]), batch)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_suffix_after_cached_blocks_gives_the_full_prefills_logits(demo_checkpoint, dtype):
    """A prompt's KV stored from one prompt's prefill, loaded for another sharing 4 blocks: the
    suffix's logits are the full prefill's, within float32 summation order (SDPA with a mask
    rounds unlike SDPA is_causal) or one bf16 step (measured: bitwise equal on x86 CPUs)."""
    with Engine.from_pretrained(demo_checkpoint, EngineConfig(dtype=dtype)) as engine:
        model = engine.model
        first = engine.encode("Shared context for both prompts, long enough for blocks. " * 8)
        assert len(first) > 5 * BLOCK
        second = first[: 4 * BLOCK] + engine.encode("A different question at the end?")
        cache = KVCache(model.cfg, 2, 256, model.dtype)
        prefix_cache = PrefixCache(model.cfg, 8, model.dtype, "cpu")
        prefill_logits(model, first, 0, 0, cache)
        prefix_cache.store(first, 0, cache)
        assert prefix_cache.load(second, 1, cache) == 4 * BLOCK
        cached = prefill_logits(model, second, 4 * BLOCK, 1, cache)
        reference = prefill_logits(model, second, 0, 0, KVCache(model.cfg, 1, 256, model.dtype))
    step = reference.abs() * 2.0**-7 if dtype == "bfloat16" else 1e-4
    diff = (cached - reference).abs()
    assert bool((diff <= step).all()), f"max diff {diff.max():.3g}"


# --- end to end: with the cache against without ----------------------------------------------


def scenario_prompts(encode) -> dict[str, list[list[list[int]]]]:
    """scenario -> rounds, each a list of prompts submitted together."""
    system = encode("You are a careful assistant. Think step by step and answer briefly.\n" * 4)
    a, b, c = (system + encode(s) for s in ("def fibonacci(n):", "The capital of", "x = [1,"))
    whole = system[: 3 * BLOCK]  # exactly three blocks: the last token is prefilled again
    return {
        "shared_prefix": [[a], [b]],
        "whole_prompt": [[whole], [whole]],
        "batched": [[a, b, c, a]],
        "eviction": [[a], [a], [encode("Once upon a time, " * 4)], [a]],
    }


def shared_blocks(prompt: list[int], earlier: list[list[int]]) -> int:
    """Whole blocks `prompt` shares with the longest-matching of `earlier` prompts' blocks."""
    best = 0
    for other in earlier:
        n = 0
        while (n + 1) * BLOCK <= min(len(prompt), len(other)) and (
            prompt[n * BLOCK : (n + 1) * BLOCK] == other[n * BLOCK : (n + 1) * BLOCK]
        ):
            n += 1
        best = max(best, n)
    return best


def expected_cached(rounds: list[list[list[int]]]) -> int:
    """Prompt positions reused over `rounds` by a pool that never evicts."""
    total, earlier = 0, []
    for prompts in rounds:
        for prompt in prompts:  # each is prefilled and stored before the next is admitted
            total += min(shared_blocks(prompt, earlier) * BLOCK, len(prompt) - 1)
            earlier.append(prompt)
    return total


def run_rounds(engine: Engine, rounds) -> tuple[list[list[list[int]]], int]:
    """Greedy tokens per round, and the prompt positions the prefix cache held over them."""
    tokens, cached = [], 0
    for prompts in rounds:
        tokens.append(engine.generate_ids(prompts, GREEDY))
        cached += engine.stats.cached_prompt_tokens
    return tokens, cached


def check_exact(directory, dtype: str, target: str, encode=None) -> None:
    """Every scenario gives the tokens of an engine without a prefix cache, and reuses what
    the block arithmetic says (the tiny pool: what fits in two blocks)."""
    base = EngineConfig(dtype=dtype, max_batch=4, offload=TARGETS[target])
    pools = (0, None, TINY_POOL_TOKENS)  # off, the default, two blocks
    engines = [
        Engine.from_pretrained(directory, replace(base, prefix_cache_tokens=tokens))
        for tokens in pools
    ]
    off, *cached_engines = engines
    try:
        for name, rounds in scenario_prompts(encode or off.encode).items():
            reference, none_cached = run_rounds(off, rounds)
            assert none_cached == 0
            for engine in cached_engines:
                tokens, cached = run_rounds(engine, rounds)
                assert tokens == reference, (name, target, dtype)
                assert cached > 0, f"{name}: every scenario shares a prefix"
                engine.scheduler.prefix_cache.tree.check()
    finally:
        for engine in engines:
            engine.close()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_tokens_are_identical_with_and_without_the_cache(demo_checkpoint, dtype, target):
    check_exact(demo_checkpoint, dtype, target)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    return write_hf_checkpoint("qwen2_moe", "shared_expert", tmp_path_factory.mktemp("ckpt"))


def random_ids_encoder():
    """Text -> ids in the tiny checkpoint's vocabulary (no tokenizer), deterministic."""

    def encode(text: str) -> list[int]:
        generator = torch.Generator().manual_seed(sum(map(ord, text)))
        return torch.randint(3, 96, (len(text) // 3,), generator=generator).tolist()

    return encode


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hf_checkpoint_tokens_are_identical_with_and_without_the_cache(
    hf_checkpoint, dtype, target
):
    check_exact(hf_checkpoint, dtype, target, random_ids_encoder())


# --- what is reported, and failures ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine(demo_checkpoint):
    config = EngineConfig(dtype="float32", max_batch=4)
    with Engine.from_pretrained(demo_checkpoint, config) as engine:
        yield engine


def test_cached_tokens_are_the_reused_length(engine, demo_checkpoint):
    for name, rounds in scenario_prompts(engine.encode).items():
        fresh = Engine.from_pretrained(demo_checkpoint, engine.config)
        with fresh:
            assert run_rounds(fresh, rounds)[1] == expected_cached(rounds), name
            stats = fresh.scheduler.stats()
            queried = sum(len(p) for prompts in rounds for p in prompts)
            assert stats.prefix_cache.queried_tokens == queried == stats.prompt_tokens
            assert stats.prefix_cache.hit_tokens == expected_cached(rounds)
            assert stats.cached_prompt_tokens == expected_cached(rounds)


def test_a_submitted_request_carries_its_cached_tokens(engine):
    a, b = scenario_prompts(engine.encode)["shared_prefix"]
    engine.generate_ids(a, GREEDY)
    scheduler = engine.scheduler
    seq = engine.new_sequence(b[0], GREEDY, with_text=False)
    request = scheduler.submit(seq, lambda output: None)
    while not seq.finished:
        scheduler.step()
    assert request.cached_tokens == shared_blocks(b[0], a) * BLOCK > 0


def test_a_failing_prefill_leaves_the_tree_as_it_was(engine, monkeypatch):
    cache = engine.scheduler.prefix_cache
    prompt = engine.encode("A prompt never seen before, long enough for two whole blocks.")
    before = cache.stats().blocks_used

    def failing(*args):
        raise RuntimeError("injected prefill failure")

    monkeypatch.setattr(steps, "prefill", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate_ids([prompt], GREEDY)
    cache.tree.check()
    assert cache.stats().blocks_used == before
    monkeypatch.undo()
    assert len(engine.generate_ids([prompt], GREEDY)[0]) == GREEDY.max_tokens


def test_a_failing_store_fails_its_request_and_rolls_the_tree_back(engine, monkeypatch):
    cache = engine.scheduler.prefix_cache
    prompt = engine.encode("Yet another prompt that nobody has sent, of several whole blocks.")
    before = cache.stats().blocks_used

    def failing(*args):
        raise RuntimeError("injected store failure")

    monkeypatch.setattr(cache.pool, "store_row", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate_ids([prompt], GREEDY)
    cache.tree.check()
    assert cache.stats().blocks_used == before
    assert len(engine.scheduler.free_rows) == engine.config.max_batch


def test_cancelled_requests_leave_the_tree_consistent(engine):
    scheduler = engine.scheduler
    prompts = scenario_prompts(engine.encode)["batched"][0]
    requests = [
        scheduler.submit(engine.new_sequence(p, GREEDY, with_text=False), lambda o: None)
        for p in prompts
    ]
    requests[0].cancel()  # before admission
    scheduler.step()  # the others are admitted
    for request in requests[1:]:
        request.cancel()
    scheduler.step()
    assert scheduler.idle and len(scheduler.free_rows) == engine.config.max_batch
    scheduler.prefix_cache.tree.check()
    assert scheduler.stats().prefix_cache.blocks_used > 0, "admitted prompts stay cached"
