"""A whole drafter round at Qwen3-4B shapes, split into backbone pass, head scoring and tree
selection, for the real heads (Domino GRU, DSpark Markov) with random weights.

    python -m vllm_dartree.bench.drafter_round [--batches 1 8] [--context 512] [--repeats 5]
        [--shapes qwen3-4b|smollm2] [--draft-vocab 8192]

Backbone: 5 Qwen3 layers (H 2560, 32/8 heads of 128, MLP 9728), context K/V of `--context`
tokens per request already cached, query block of 16 (Domino) or 7 (DSpark) slots, base logits
through a 151936-row lm_head. Then DARTree pruned (K 64, W 12, B 64, beta -0.2). "head" is the
time spent inside the head's init/prepare/score/advance; "selection" is the rest of the build
(candidate tables, scoring arithmetic, top-W, final top-B). Medians over repeats.
`--shapes smollm2`: the shipped SmolLM2 drafter's shapes (1 layer, H 576, 9/3 heads of 64, MLP
1536, 49,152 tokens, GRU 256, E 64). `--draft-vocab N` adds a Domino row whose drafter scores
N tokens only (a reduced draft vocabulary).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from vllm_dartree import DARTreeConfig
from vllm_dartree.drafter import ContextCache, DFlashBackbone, DominoGRUHead, MarkovHead
from vllm_dartree.drafter import parse_drafter_config
from vllm_dartree.tree import build_tree

__all__ = ["main"]

SHAPES = {   # name -> (backbone config, GRU hidden, E, Markov rank)
    "qwen3-4b": ({"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 5,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "vocab_size": 151936, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                  "num_target_layers": 36}, 1024, 256, 256),
    "smollm2": ({"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 1,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                 "vocab_size": 49152, "rope_theta": 1e5, "rms_norm_eps": 1e-5,
                 "num_target_layers": 30}, 256, 64, 64),
}
LAYER_IDS = [1, 8, 14, 20, 27]   # (which layers changes no cost: 5 of them)


def _config(fmt: str, shapes: str, draft_vocab: int = 0) -> dict:
    base, gru, emb, rank = SHAPES[shapes]
    base = dict(base, draft_vocab_size=draft_vocab)
    if fmt == "domino":
        return base | {"architectures": ["DominoDraftModel"], "block_size": 16,
                       "dflash_config": {"projector_type": "domino", "emb_dim": emb,
                                         "gru_hidden_dim": gru, "pure_draft_prefix_len": 1,
                                         "shift_label": True, "mask_token_id": 0,
                                         "target_layer_ids": LAYER_IDS}}
    return base | {"architectures": ["Qwen3DSparkModel"], "block_size": 7, "markov_rank": rank,
                   "markov_head_type": "vanilla", "mask_token_id": 0,
                   "target_layer_ids": LAYER_IDS}


class _TimedHead:
    """Delegates to a correction head and accumulates the seconds spent inside it."""

    def __init__(self, head):
        self.head, self.num_uncorrected, self.seconds = head, head.num_uncorrected, 0.0

    def _run(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - start
        return out

    def init(self, *a):
        return self._run(self.head.init, *a)

    def prepare(self, *a):
        return self._run(self.head.prepare, *a)

    def score(self, *a):
        return self._run(self.head.score, *a)

    def advance(self, *a):
        return self._run(self.head.advance, *a)


def _build(fmt: str, shapes: str, embed: torch.Tensor, draft_vocab: int = 0):
    spec = parse_drafter_config(_config(fmt, shapes, draft_vocab))
    backbone = DFlashBackbone(spec, embed, embed).eval()
    if draft_vocab:
        backbone.set_draft_vocab(torch.randperm(spec.vocab_size)[:draft_vocab].sort().values)
    if fmt == "domino":
        head = DominoGRUHead(spec.hidden_size, spec.gru_hidden_size, spec.emb_dim,
                             spec.output_size, embed, num_uncorrected=1).eval()
        head.use_input_table()
    else:
        head = MarkovHead(spec.vocab_size, spec.markov_rank).eval()
    return spec, backbone, head


@torch.inference_mode()
def _measure(backbone, head, spec, batch: int, context: int, repeats: int) -> list[float]:
    cache, rids = ContextCache(), list(range(batch))
    feats = [0.1 * torch.randn(context, len(spec.target_layer_ids) * spec.hidden_size)
             for _ in rids]
    backbone.extend_context(cache, rids, feats)
    roots = torch.randint(0, spec.vocab_size, (batch,))
    config = DARTreeConfig()
    rows = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        out = backbone(cache, rids, roots)
        t1 = time.perf_counter()
        timed = _TimedHead(head)
        build_tree(config, out.base_logits, out.hidden, roots, timed, out.vocab_ids)
        t2 = time.perf_counter()
        if rep:   # the first round warms up
            rows.append([t1 - t0, timed.seconds, t2 - t1 - timed.seconds, t2 - t0])
    return [1000 * statistics.median(col) for col in zip(*rows)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="add a Domino row with a draft vocabulary of N tokens")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    base = SHAPES[args.shapes][0]
    embed = 0.02 * torch.randn(base["vocab_size"], base["hidden_size"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, "
          f"{args.shapes} shapes, context {args.context}, DARTree pruned K 64 W 12 B 64",
          flush=True)
    lines = ["| drafter | batch | backbone pass (ms) | head scoring (ms) | tree selection (ms) "
             "| round (ms) |", "|---|---|---|---|---|---|"]
    rows = [("domino", "Domino GRU, 16 depths", 0), ("dspark", "DSpark Markov, 7 depths", 0)]
    if args.draft_vocab:
        rows.insert(1, ("domino", f"Domino GRU, 16 depths, draft vocabulary {args.draft_vocab}",
                        args.draft_vocab))
    for fmt, label, draft_vocab in rows:
        spec, backbone, head = _build(fmt, args.shapes, embed, draft_vocab)
        for batch in args.batches:
            ms = _measure(backbone, head, spec, batch, args.context, args.repeats)
            print(f"  {label} batch {batch}: {ms}", file=sys.stderr, flush=True)
            lines.append(f"| {label} | {batch} | " + " | ".join(f"{x:.1f}" for x in ms) + " |")
        del backbone, head
    print("\n".join(lines))


if __name__ == "__main__":
    main()
