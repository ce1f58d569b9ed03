"""What the runner drafts with: per-request context, one batched draft per round -> trees.

`TreeDrafter` is the runner's whole view of a drafter. Context is appended in the order the
target commits tokens (prompt chunks, then each round's root + accepted nodes) together with
the target's features of those tokens; `length(rid)` is therefore the position of the
request's next root, which the runner checks before every draft.

- `CheckpointTreeDrafter`: a released or trained checkpoint (DFlash / Domino / DSpark) and
  the tree builder of the DARTreeConfig (`vllm_dartree.tree.build_tree`, replayed from CUDA
  graphs per batch-size bucket on GPU: `vllm_dartree.tree.graphs`).
- `OracleTreeDrafter`: knows the target's greedy continuations (a JSON file written by the
  tests), so a correct engine accepts every depth: tau = depth + 1 proves positions, masks
  and KV compaction inside vLLM. Selected with `drafter_class`.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from typing import Protocol

import torch

from vllm_dartree.config import DARTreeConfig
from vllm_dartree.drafter import ContextCache, Drafter
from vllm_dartree.tree import TreeBatch
from vllm_dartree.tree.graphs import DEFAULT_BUCKETS, GraphedTreeBuilder

__all__ = ["TreeDrafter", "CheckpointTreeDrafter", "OracleTreeDrafter"]


class TreeDrafter(Protocol):
    layer_ids: tuple[int, ...]   # target layers (0-based) whose outputs are the context features

    def length(self, rid: Hashable) -> int: ...

    def trim(self, rid: Hashable, length: int) -> None: ...

    def free(self, rid: Hashable) -> None: ...

    def extend(self, rids: Sequence[Hashable], tokens: Sequence[Sequence[int]],
               features: Sequence[torch.Tensor]) -> None: ...

    num_depths: int              # deepest tree level it can draft

    def draft(self, rids: Sequence[Hashable], roots: torch.Tensor,
              num_depths: int | None = None) -> TreeBatch:
        """Trees for `rids` in best-first order; `num_depths` (default all) caps their depth."""


class CheckpointTreeDrafter:
    def __init__(self, config: DARTreeConfig, drafter: Drafter, cuda_graphs: bool = True,
                 max_batch: int | None = None):
        self.config, self.drafter = config, drafter
        self.layer_ids = tuple(drafter.spec.target_layer_ids)
        self.cache = ContextCache()
        # construction from CUDA graphs on CUDA tensors (eager on CPU or with cuda_graphs
        # off); buckets up to the engine's max_num_seqs, so no graph is wider than a batch
        buckets = DEFAULT_BUCKETS
        if max_batch is not None:
            buckets = tuple(b for b in DEFAULT_BUCKETS if b < max_batch) + (max_batch,)
        # the backbone projects only the depths asked for (max_depth is applied there), so
        # the builder grows whatever depths it is given
        self.builder = GraphedTreeBuilder(config.model_copy(update={"max_depth": None}),
                                          drafter.head, buckets=buckets,
                                          use_graphs=None if cuda_graphs else False,
                                          vocab_ids=drafter.vocab_ids)

    def length(self, rid: Hashable) -> int:
        return self.cache.length(rid)

    def trim(self, rid: Hashable, length: int) -> None:
        self.cache.trim(rid, length)

    def free(self, rid: Hashable) -> None:
        self.cache.free(rid)

    def extend(self, rids, tokens, features) -> None:
        self.drafter.backbone.extend_context(self.cache, list(rids), list(features))

    @property
    def num_depths(self) -> int:
        return self.config.num_depths(self.drafter.spec.num_depths)

    def draft(self, rids, roots: torch.Tensor, num_depths: int | None = None) -> TreeBatch:
        depths = self.num_depths if num_depths is None else min(num_depths, self.num_depths)
        out = self.drafter.backbone(self.cache, list(rids), roots, num_depths=depths)
        return self.builder(out.base_logits, out.hidden, roots)[0]


class OracleTreeDrafter:
    """Trees that contain the target's greedy continuation (chain + one wrong sibling per
    depth), read from a JSON file: {"layer_ids": [...], "depth": D,
    "continuations": [[prompt_ids, greedy_output_ids], ...]}."""

    def __init__(self, config: DARTreeConfig, path: str, vocab_size: int):
        data = json.loads(open(path).read())
        self.config, self.vocab_size = config, vocab_size
        self.layer_ids = tuple(data.get("layer_ids", [0]))
        self.depth = int(data["depth"])
        self.table = [(list(p), list(o)) for p, o in data["continuations"]]
        self.tokens: dict[Hashable, list[int]] = {}

    def length(self, rid) -> int:
        return len(self.tokens.get(rid, ()))

    def trim(self, rid, length: int) -> None:
        self.tokens[rid] = self.tokens.get(rid, [])[:length]

    def free(self, rid) -> None:
        self.tokens.pop(rid, None)

    def extend(self, rids, tokens, features) -> None:
        for rid, toks in zip(rids, tokens):
            self.tokens.setdefault(rid, []).extend(int(t) for t in toks)

    def _continuation(self, seq: list[int]) -> list[int]:
        for prompt, output in self.table:
            full = prompt + output
            if len(seq) >= len(prompt) and full[:len(seq)] == seq:
                return full[len(seq):len(seq) + self.depth]
        return []

    @property
    def num_depths(self) -> int:
        return self.depth

    def draft(self, rids, roots: torch.Tensor, num_depths: int | None = None) -> TreeBatch:
        budget = self.config.budget
        depth = self.depth if num_depths is None else min(num_depths, self.depth)
        trees = []
        for rid, root in zip(rids, roots.tolist()):
            cont = self._continuation(self.tokens.get(rid, []) + [int(root)])[:depth]
            tokens, parents, depths = [], [], []
            for d, tok in enumerate(cont, start=1):
                parent = -1 if d == 1 else len(tokens) - 2   # previous chain node
                tokens += [tok, (tok + 1) % self.vocab_size]
                parents += [parent, parent]
                depths += [d, d]
            trees.append((tokens[:budget], parents[:budget], depths[:budget]))
        n = max(1, max(len(t[0]) for t in trees))
        tok = torch.zeros(len(trees), n, dtype=torch.long)
        dep = torch.zeros(len(trees), n, dtype=torch.long)
        par = torch.full((len(trees), n), -1, dtype=torch.long)
        scores = torch.full((len(trees), n), float("-inf"))
        for r, (t, p, d) in enumerate(trees):
            m = len(t)
            tok[r, :m], par[r, :m], dep[r, :m] = torch.tensor(t), torch.tensor(p), torch.tensor(d)
            scores[r, :m] = 0.0
        num = torch.tensor([len(t[0]) for t in trees], dtype=torch.long)
        return TreeBatch(tok, par, dep, scores, num)
