"""What a GGUF's vocabulary costs a load: its metadata read (our gguf_read vs gguf-py's
GGUFReader, the reference it replaced) and the tokenizer built from it, at a real vocabulary's
size (Qwen3's: 151936 tokens, ~151k merges), side by side in one process.

    python benchmarks/bench_gguf_vocab.py [--vocab 151936] [--dir /tmp/bench-gguf-vocab]

Writes (once) a GGUF holding only tokenizer metadata: 256 byte-level symbols, then tokens made
by merging two earlier tokens chosen at random (so every merge is valid BPE), `qwen2`
pre-tokenizer. Prints the load average and the best of 3 wall seconds of each step.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path


def write_vocab_gguf(path: Path, vocab: int) -> None:
    import gguf

    from hybridmoe.loader.token_bytes import _byte_level_alphabet

    rng = random.Random(0)
    tokens = sorted(_byte_level_alphabet(), key=_byte_level_alphabet().get)  # 256 symbols
    seen, merges = set(tokens), []
    while len(tokens) < vocab - 2:
        left = tokens[rng.randrange(len(tokens))]
        right = tokens[rng.randrange(min(len(tokens), 2000))]
        if left + right not in seen:
            seen.add(left + right)
            tokens.append(left + right)
            merges.append(f"{left} {right}")
    tokens += ["<|endoftext|>", "<|im_start|>"]
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 2) + [3, 3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab - 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def best_s(fn, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench-gguf-vocab"))
    args = parser.parse_args()
    import gguf

    from hybridmoe.loader.gguf import GgufFile
    from hybridmoe.loader.gguf_read import read_gguf
    from hybridmoe.loader.gguf_tokenizer import gguf_tokenizer

    path = args.dir / f"vocab-{args.vocab}.gguf"
    if not path.exists():
        args.dir.mkdir(parents=True, exist_ok=True)
        write_vocab_gguf(path, args.vocab)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"vocabulary of {args.vocab} tokens; load average {load}")
    theirs = best_s(lambda: gguf.GGUFReader(path, mode="c"), runs=1)
    ours = best_s(lambda: read_gguf(path))
    print(f"  metadata: GGUFReader {theirs:.3f} s, gguf_read {ours:.3f} s ({theirs / ours:.0f}x)")
    file = GgufFile(path)
    print(f"  tokenizer from the metadata: {best_s(lambda: gguf_tokenizer(file)):.3f} s")


if __name__ == "__main__":
    main()
