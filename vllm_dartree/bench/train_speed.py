"""Drafter training throughput: supervised positions per second of `zoo.train` steps, for
several recipes side by side, measured in one run (interleaved, so machine noise hits every
row alike).

    python -m vllm_dartree.bench.train_speed [--target DIR] [--repeats 3] [--steps 3]

Shapes are the target's (SmolLM2-135M-Instruct by default: hidden 576, 49,152 tokens, the
shipped drafter's 5 target layers, 342-token sequences with 129 prompt tokens, 4 sequences x
32 anchors per step); weights and sequences are random, which changes nothing in a step's
cost. The sequences' tokens lie inside the smallest draft vocabulary, so every row
supervises the same labels: a supervised position is one (anchor, depth) label. Rows in
fp32; `--bf16` adds bf16-autocast rows (about 3x faster than fp32 with AMX, the shipped
drafter's setting; about 25x slower on AVX2-only CPUs).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Recipe", "RECIPES", "measure", "main"]


@dataclass(frozen=True)
class Recipe:
    name: str
    draft_vocab: int = 0       # 0: the target's whole vocabulary
    bf16: bool = True
    sequences: int = 4
    anchors: int = 32


RECIPES = (
    Recipe("full vocabulary (the shipped drafter's recipe)", bf16=False),
    Recipe("draft vocabulary N = 16384", 16384, bf16=False),
    Recipe("draft vocabulary N = 8192", 8192, bf16=False),
    Recipe("draft vocabulary N = 8192, 8 sequences", 8192, bf16=False, sequences=8),
)
# bf16 autocast: ~3x faster than fp32 with AMX (Xeon), ~25x slower on AVX2-only CPUs
BF16_RECIPES = (
    Recipe("full vocabulary, bf16 (the shipped drafter's run, on AMX)"),
    Recipe("draft vocabulary N = 8192, bf16", 8192),
)


def _shapes(target: Path | None) -> dict:
    if target is not None:
        cfg = json.loads((Path(target) / "config.json").read_text())
    else:   # SmolLM2-135M-Instruct
        cfg = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
               "num_key_value_heads": 3, "vocab_size": 49152, "num_hidden_layers": 30,
               "rope_theta": 100000.0, "rms_norm_eps": 1e-5}
    return cfg


def _trainer(recipe: Recipe, cfg: dict, layers: list[int], workdir: Path, order: torch.Tensor):
    """order: a permutation of the vocabulary; a draft vocabulary of N is its first N ids
    (the sequences' tokens are drawn from the smallest one, so every row supervises the
    same labels)."""
    from types import SimpleNamespace

    from vllm_dartree.zoo.train import DrafterTrainer, TrainConfig, spec_for_target
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    embed = 0.02 * torch.randn(vocab, hidden, generator=gen)
    ids = order[:recipe.draft_vocab].sort().values if recipe.draft_vocab else None
    spec = spec_for_target(SimpleNamespace(**cfg), layers, draft_vocab_size=recipe.draft_vocab)
    config = TrainConfig(steps=10**6, sequences_per_step=recipe.sequences,
                         anchors_per_sequence=recipe.anchors, bf16=recipe.bf16,
                         checkpoint_every=10**9)
    return DrafterTrainer(spec, embed, embed, config, workdir, learn_mask_embedding=True,
                          draft_vocab=ids)


def _sequences(cfg: dict, layers: list[int], count: int, length: int, prompt: int,
               tokens: torch.Tensor):
    from vllm_dartree.zoo.train import FeatureShard
    gen = torch.Generator().manual_seed(1)
    width = len(layers) * cfg["hidden_size"]
    return [FeatureShard(tokens[torch.randint(tokens.numel(), (length,), generator=gen)],
                         torch.randn(length, width, generator=gen).to(torch.bfloat16), prompt)
            for _ in range(count)]


def measure(recipes=RECIPES, target: Path | None = None, repeats: int = 3, steps: int = 3,
            length: int = 342, prompt: int = 129, progress=print) -> list[dict]:
    """Rows {recipe, positions_per_s, seconds_per_step, ratio} (ratio: over the first row)."""
    cfg = _shapes(target)
    layers = [1, 8, 14, 20, 27] if cfg["num_hidden_layers"] >= 28 else [0]
    order = torch.randperm(cfg["vocab_size"], generator=torch.Generator().manual_seed(2))
    smallest = min((r.draft_vocab for r in recipes if r.draft_vocab), default=cfg["vocab_size"])
    seqs = _sequences(cfg, layers, 16, length, prompt, order[:smallest])
    seconds = {r.name: 0.0 for r in recipes}
    positions = {r.name: 0 for r in recipes}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {r.name: _trainer(r, cfg, layers, Path(tmp) / str(i), order)
                    for i, r in enumerate(recipes)}
        for t in trainers.values():        # warm-up step (allocations, autocast caches)
            t.train_step(seqs)
        for rep in range(repeats):
            for r in recipes:
                t = trainers[r.name]
                start = time.perf_counter()
                for _ in range(steps):
                    record = t.train_step(seqs)
                    positions[r.name] += record["positions"]
                seconds[r.name] += time.perf_counter() - start
                progress(f"repeat {rep + 1}/{repeats}: {r.name}: "
                         f"{positions[r.name] / seconds[r.name]:.0f} positions/s")
    base = positions[recipes[0].name] / seconds[recipes[0].name]
    return [{"recipe": r.name, "positions_per_s": positions[r.name] / seconds[r.name],
             "seconds_per_step": seconds[r.name] / (repeats * steps),
             "ratio": positions[r.name] / seconds[r.name] / base} for r in recipes]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.bench.train_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, help="a target folder (default: SmolLM2 shapes)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row and repeat")
    parser.add_argument("--bf16", action="store_true",
                        help="add the bf16-autocast rows (slow without AMX)")
    args = parser.parse_args(argv)
    recipes = RECIPES + (BF16_RECIPES if args.bf16 else ())
    rows = measure(recipes, target=args.target, repeats=args.repeats, steps=args.steps)
    print("\n| recipe | s / step | supervised positions / s | vs the first row |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['recipe']} | {row['seconds_per_step']:.2f} | "
              f"{row['positions_per_s']:.0f} | {row['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
