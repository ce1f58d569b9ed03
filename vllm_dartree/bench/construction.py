"""Per-round tree construction time at Qwen3-4B-like shapes, every builder in one run.

    python -m vllm_dartree.bench.construction [--batches 1 8] [--repeats 15] [--json FILE]

What one "round" includes, for every method: the top-K candidate tables from the base
logits [R, D, V], the head's per-round projections, and the tree build itself (no backbone,
no target); the methods take turns within every repeat. The Domino-shaped GRU head has
random weights (H 2560, G 1024, E 256, V 151936); trees use K 64, W 12, 16 depths, B 64,
beta -0.2. Times are medians over repeats; the ratios at the end are what to read (the
machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from vllm_dartree import DARTreeConfig
from vllm_dartree.drafter import DominoGRUHead
from vllm_dartree.tree import build_tree

__all__ = ["main", "parser", "run"]

METHODS = {
    "dartree-pruned": DARTreeConfig(),
    "dartree-fixed": DARTreeConfig(variant="fixed"),
    "ddtree": DARTreeConfig(builder="ddtree"),
    "sequential-heap": DARTreeConfig(builder="sequential-heap"),
}


def _make_head(args: argparse.Namespace, dtype: torch.dtype) -> DominoGRUHead:
    gen = torch.Generator().manual_seed(0)
    embed = (0.02 * torch.randn(args.vocab, args.hidden, generator=gen)).to(dtype)
    head = DominoGRUHead(args.hidden, args.gru, args.emb, args.vocab, embed).to(dtype)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    if args.input_table:
        head.use_input_table()
    return head.eval()


def _time_rounds(inputs, head, repeats: int) -> dict[str, float]:
    """Median ms per round of every method; methods interleave within each repeat so that
    a change in the machine's load hits all of them alike."""
    for config in METHODS.values():                      # warm-up (allocator, caches)
        build_tree(config, *inputs, head)
    samples: dict[str, list[float]] = {name: [] for name in METHODS}
    for _ in range(repeats):
        for name, config in METHODS.items():
            start = time.perf_counter()
            build_tree(config, *inputs, head)
            samples[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(ts) for name, ts in samples.items()}


@torch.inference_mode()
def run(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    dtype = getattr(torch, args.dtype)
    head = _make_head(args, dtype)
    results: dict[str, dict[int, float]] = {m: {} for m in METHODS}
    for batch in args.batches:
        gen = torch.Generator().manual_seed(batch)
        logits = (3 * torch.randn(batch, args.depths, args.vocab, generator=gen)).to(dtype)
        hidden = torch.randn(batch, args.depths, args.hidden, generator=gen).to(dtype)
        roots = torch.randint(0, args.vocab, (batch,), generator=gen)
        for name, ms in _time_rounds((logits, hidden, roots), head, args.repeats).items():
            results[name][batch] = ms
            print(f"  {name:16s} batch {batch}: {ms:8.1f} ms", file=sys.stderr, flush=True)
    return results


def _table(results: dict[str, dict[int, float]], batches: list[int]) -> str:
    first, last = batches[0], batches[-1]
    head = "| method | " + " | ".join(f"batch {b} (ms)" for b in batches)
    head += f" | batch {last} / batch {first} |" if len(batches) > 1 else " |"
    rows = [head, "|" + "---|" * (len(batches) + 1 + (len(batches) > 1))]
    for name, per_batch in results.items():
        cells = " | ".join(f"{per_batch[b]:.1f}" for b in batches)
        growth = f" | {per_batch[last] / per_batch[first]:.2f}x |" if len(batches) > 1 else " |"
        rows.append(f"| {name} | {cells}{growth}")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="float32 on CPU: its bf16 GEMM for a few rows is slow there")
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--gru", type=int, default=1024)
    parser.add_argument("--emb", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--depths", type=int, default=16)
    parser.add_argument("--no-input-table", dest="input_table", action="store_false",
                        help="compute embed @ W_ih per GRU step instead of the [V, 3G] table "
                             "(the released code's fast path, used by every method)")
    parser.add_argument("--json", help="also write the medians (ms) to this file")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"H {args.hidden} G {args.gru} E {args.emb} V {args.vocab} D {args.depths}, "
          f"K 64 W 12 B 64 beta -0.2, GRU input table {'on' if args.input_table else 'off'}",
          flush=True)
    results = run(args)
    print(_table(results, args.batches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "median_ms": results}, f, indent=2)
    base = args.batches[0]
    ratio = results["sequential-heap"][base] / results["dartree-pruned"][base]
    print(f"sequential-heap/dartree ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
