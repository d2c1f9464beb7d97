"""Train the embedded demo model: a small Qwen3-MoE on the Python standard library's source.

On the training split of hybridmoe.demo.corpus it trains a byte-level BPE tokenizer
(`tokenizers`), then the model (`transformers`' Qwen3MoeForCausalLM, with its router
load-balancing loss), and writes a Hugging Face checkpoint directory. The same seed, thread
count and library versions give the same files.

Run:  python scripts/train_demo_model.py --threads 1                        # ~40 min, one core
      python scripts/train_demo_model.py --steps 20 --out /tmp/demo-smoke   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hybridmoe.demo import demo_checkpoint_dir
from hybridmoe.demo.corpus import read_texts, split_corpus, token_stream
from hybridmoe.demo.perplexity import windows

VOCAB_SIZE = 4096
# Order fixes the ids: <|endoftext|> is 0, <|im_end|> (the end of a chat turn, EOS) is 2.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT_ID, IM_END_ID = 0, 2
CONTEXT = 512  # training sequence length, and the checkpoint's context window
# ChatML as Qwen writes it, without a default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# config.json in the spelling of published Qwen3-MoE checkpoints. ~4.1M parameters: layer 0 is
# a dense MLP (mlp_only_layers), layers 1-5 route each token to 2 of 8 SwiGLU experts.
MODEL_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 192,
    "intermediate_size": 384,
    "moe_intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": CONTEXT,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "eos_token_id": IM_END_ID,
    "torch_dtype": "float32",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=demo_checkpoint_dir(), help="checkpoint dir")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help=f"sequences of {CONTEXT} tokens")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--aux-loss-coef", type=float, default=0.01, help="router balancing")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between evals")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows per eval")
    args = parser.parse_args()
    for name in ("threads", "steps", "batch_size", "eval_every", "eval_windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any text (emoji, CJK) encodes even if the corpus lacks it.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONTEXT,
        "chat_template": CHAT_TEMPLATE,
    }


def build_model(args: argparse.Namespace) -> Qwen3MoeForCausalLM:
    torch.manual_seed(args.seed)
    config = Qwen3MoeConfig(
        **MODEL_CONFIG, router_aux_loss_coef=args.aux_loss_coef, output_router_logits=True
    )
    model = Qwen3MoeForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters ({params * 4 / 1e6:.1f} MB in float32)")
    return model


def sample_batch(stream: torch.Tensor, args: argparse.Namespace, gen: torch.Generator):
    """Random windows of the training stream: inputs and next-token labels, [B, CONTEXT] each."""
    starts = torch.randint(0, len(stream) - CONTEXT - 1, (args.batch_size,), generator=gen)
    rows = torch.stack([stream[s : s + CONTEXT + 1] for s in starts.tolist()])  # [B, CONTEXT+1]
    return rows[:, :-1], rows[:, 1:]


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def losses(model: Qwen3MoeForCausalLM, inputs: torch.Tensor, labels: torch.Tensor):
    """(next-token cross-entropy, router load-balancing loss) on one batch."""
    out = model(input_ids=inputs)
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())  # over [B*T, V]
    return ce, out.aux_loss


@torch.no_grad()
def held_out_loss(model: Qwen3MoeForCausalLM, held_out: list[torch.Tensor]) -> float:
    model.eval()
    total = sum(losses(model, w[None, :-1], w[None, 1:])[0].item() for w in held_out)
    model.train()
    return total / len(held_out)


def train(
    model: Qwen3MoeForCausalLM,
    stream: torch.Tensor,
    held_out: list[torch.Tensor],
    args: argparse.Namespace,
) -> tuple[float, float]:
    """Runs args.steps AdamW steps; returns (final train loss, final held-out loss)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # not the norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    smoothed = None
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        ce, aux = losses(model, *sample_batch(stream, args, gen))
        (ce + args.aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        smoothed = ce.item() if smoothed is None else 0.95 * smoothed + 0.05 * ce.item()
        bar.set_postfix(loss=f"{smoothed:.3f}", aux=f"{aux.item():.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            held = held_out_loss(model, held_out)
            bar.write(f"step {step + 1}: train loss {smoothed:.3f}, held-out loss {held:.3f}")
    return smoothed, held


def save_checkpoint(model: Qwen3MoeForCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    """Writes the five checkpoint files into `out`, replacing any earlier ones."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as staging:
        # transformers writes the experts one tensor each, as published checkpoints hold them.
        model.save_pretrained(staging)
        shutil.copyfile(Path(staging) / "model.safetensors", out / "model.safetensors")
    config = dict(MODEL_CONFIG, router_aux_loss_coef=model.config.router_aux_loss_coef)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}  # end of a chat turn or of a text
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)  # indented, it doubles in size
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.threads > 1 else "false"
    start = time.monotonic()
    split = split_corpus()
    train_texts, held_texts = read_texts(split.train), read_texts(split.held_out)
    print(f"corpus: {len(split.train)} training files, {len(split.held_out)} held out")
    tokenizer = train_tokenizer(train_texts)
    stream = torch.tensor(token_stream(tokenizer, train_texts))
    held_ids = token_stream(tokenizer, held_texts)
    held_out = [torch.tensor(w) for w in windows(held_ids, CONTEXT + 1)][: args.eval_windows]
    tokens_seen = args.steps * args.batch_size * CONTEXT
    print(f"tokens: {len(stream):,} training, {len(held_ids):,} held out; ", end="")
    print(f"{args.steps} steps see {tokens_seen:,} ({tokens_seen / len(stream):.1f} epochs)")
    model = build_model(args)
    train_loss, held_loss = train(model, stream, held_out, args)
    save_checkpoint(model, tokenizer, args.out)
    size_mb = sum(p.stat().st_size for p in args.out.iterdir()) / 1e6
    minutes = (time.monotonic() - start) / 60
    held = f"held-out {held_loss:.3f} ({args.eval_windows} windows)"
    print(f"final loss: train {train_loss:.3f}, {held}")
    print(f"wrote {args.out} ({size_mb:.1f} MB) in {minutes:.1f} min on {args.threads} thread(s)")


if __name__ == "__main__":
    main()
