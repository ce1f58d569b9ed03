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

import functools
import json
import random
from collections.abc import Hashable, Sequence
from typing import Protocol

import torch

from vllm_dartree.config import DARTreeConfig
from vllm_dartree.drafter import ContextCache, DominoGRUHead, Drafter
from vllm_dartree.tree import TreeBatch
from vllm_dartree.tree.graphs import DEFAULT_BUCKETS, GraphedTreeBuilder

__all__ = ["TreeDrafter", "CheckpointTreeDrafter", "OracleTreeDrafter"]


class TreeDrafter(Protocol):
    layer_ids: tuple[int, ...]   # target layers (0-based) whose outputs are the context features

    def length(self, rid: Hashable) -> int: ...

    def trim(self, rid: Hashable, length: int) -> None: ...

    def free(self, rid: Hashable) -> None: ...

    live_requests: int           # requests whose context is held (a gauge on /metrics)

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
        _use_input_table(drafter)
        _pack_linears(drafter)

    def length(self, rid: Hashable) -> int:
        return self.cache.length(rid)

    def trim(self, rid: Hashable, length: int) -> None:
        self.cache.trim(rid, length)

    def free(self, rid: Hashable) -> None:
        self.cache.free(rid)

    @property
    def live_requests(self) -> int:
        """Requests whose context is held (0 once every request has been freed)."""
        return len(self.cache)

    def extend(self, rids, tokens, features) -> None:
        self.drafter.backbone.extend_context(self.cache, list(rids), list(features))

    @property
    def num_depths(self) -> int:
        return self.config.num_depths(self.drafter.spec.num_depths)

    def draft(self, rids, roots: torch.Tensor, num_depths: int | None = None) -> TreeBatch:
        depths = self.num_depths if num_depths is None else min(num_depths, self.num_depths)
        out = self.drafter.backbone(self.cache, list(rids), roots, num_depths=depths)
        return self.builder(out.base_logits, out.hidden, roots)[0]


# the most elements of a GRU input table built for serving (64 MB in fp32): a reduced
# draft vocabulary's (SmolLM2, 8,192 x 768: 6.3M) fits, a full 150k vocabulary's does not
INPUT_TABLE_MAX_ELEMENTS = 16 * 2**20


# the largest weight `pack_for_cpu` packs (its packed copy is extra memory): 64M elements, a
# SmolLM2 lm-head (28M) but not a 150k-token one at H = 2560 (389M)
PACK_MAX_ELEMENTS = 64 * 2**20


def pack_for_cpu(weights) -> int:
    """CPU serving: give each 2-D fp32 / bf16 weight a oneDNN matmul handle (vLLM's
    `create_onednn_mm`, the path vLLM's own CPU linear layers take) as its `_dt_packed`,
    which `drafter.layers.linear` then uses. For the few rows a draft has, torch's matmul
    reaches a fraction of what the packed weights do: one core of an AMD EPYC (AVX-512),
    fp32, 12 x 576 -> 8192 (the shipped SmolLM2 drafter's lm-head for 4 requests x 3 depths)
    4.6-6.5 ms against 1.5 ms; 12 x 576 -> 1536 (its MLP) 0.35-0.65 against 0.20 ms. Call it
    once the weights are final (a packed copy does not follow later in-place changes; a
    tensor made by `.to()` or a slice is a new object and takes torch's path). Returns how
    many weights were packed: 0 without vLLM's CPU ops."""
    try:
        from vllm import _custom_ops as ops
    except Exception:   # noqa: BLE001 - no vLLM, or no CPU build of its ops
        return 0
    if not getattr(ops, "_supports_onednn", False):
        return 0
    packed = 0
    for w in weights:
        if (w is None or w.device.type != "cpu" or w.dim() != 2 or w.numel() > PACK_MAX_ELEMENTS
                or w.dtype not in (torch.float32, torch.bfloat16)
                or getattr(w, "_dt_packed", None) is not None):
            continue
        try:
            handle = ops.create_onednn_mm(w.detach().t(), 32)
        except RuntimeError:   # this CPU's oneDNN refuses the shape or dtype: torch's path
            continue
        w._dt_packed = functools.partial(ops.onednn_mm, handle, bias=None)
        packed += 1
    return packed


def _pack_linears(drafter: Drafter) -> int:
    """On CPU, the drafter's matrices (backbone, head, output rows) go through vLLM's oneDNN
    matmul (`pack_for_cpu`): the SmolLM2 drafter's pass at 4 requests x 3
    depths spent 10 of its 14 ms in torch's matmul for few rows. Returns how many."""
    backbone = drafter.backbone
    if backbone.fc.weight.device.type != "cpu":
        return 0
    weights = [p for module in (backbone, drafter.head) if module is not None
               for p in module.parameters() if p.dim() == 2]
    weights.append(backbone._output_weight_as(backbone.fc.weight.dtype))
    return pack_for_cpu(weights)


def _use_input_table(drafter: Drafter) -> None:
    """On CPU, a GRU head reads each tree depth's inputs from a table (embed @ W_ih^T) over
    the drafter's vocabulary instead of a [nodes, H] x [H, 3G] product per depth (about 15%
    of a SmolLM2 drafting round at one request, depth 8). Not on GPU: the table's
    outside-token fallback checks on the host, which graph replay cannot."""
    head = drafter.head
    if not isinstance(head, DominoGRUHead) or head.embed_weight.is_cuda:
        return
    ids = drafter.vocab_ids
    rows = head.embed_weight.shape[0] if ids is None else ids.shape[0]
    if rows * head.w_ih.shape[0] <= INPUT_TABLE_MAX_ELEMENTS:
        with torch.no_grad():
            head.use_input_table(ids=ids)


class OracleTreeDrafter:
    """Trees that contain the target's greedy continuation, read from a JSON file:
    {"layer_ids": [...], "depth": D, "continuations": [[prompt_ids, greedy_output_ids], ...]}.

    By default each depth holds the chain node first and one wrong sibling. Options (tests
    whose drafts must be accepted through every shape): "siblings": k wrong-or-right
    children per depth (k >= 1); "shuffle": a seed that puts the right child at a random
    sibling position each round; "random_depth": true cuts each round's chain at a random
    depth in 1..D; "faults": [{"kind": "raise" | "nan" | "empty" | "bad_parent" |
    "bad_token", "prompt": i, "every": n}, ...] misbehaves, for the request of continuation
    i, in every round whose context length is a multiple of n (the engine must survive it
    and stay exact)."""

    def __init__(self, config: DARTreeConfig, path: str, vocab_size: int):
        data = json.loads(open(path).read())
        self.config, self.vocab_size = config, vocab_size
        self.layer_ids = tuple(data.get("layer_ids", [0]))
        self.depth = int(data["depth"])
        self.table = [(list(p), list(o)) for p, o in data["continuations"]]
        self.siblings = max(1, int(data.get("siblings", 2)))
        self.shuffle = data.get("shuffle")
        self.random_depth = bool(data.get("random_depth", False))
        self.faults = {int(f["prompt"]): f for f in data.get("faults", ())}
        self.tokens: dict[Hashable, list[int]] = {}

    def length(self, rid) -> int:
        return len(self.tokens.get(rid, ()))

    def trim(self, rid, length: int) -> None:
        self.tokens[rid] = self.tokens.get(rid, [])[:length]

    def free(self, rid) -> None:
        self.tokens.pop(rid, None)

    @property
    def live_requests(self) -> int:
        return len(self.tokens)

    def extend(self, rids, tokens, features) -> None:
        for rid, toks in zip(rids, tokens):
            self.tokens.setdefault(rid, []).extend(int(t) for t in toks)

    def _match(self, seq: list[int]) -> int:
        for i, (prompt, output) in enumerate(self.table):
            full = prompt + output
            if len(seq) >= len(prompt) and full[:len(seq)] == seq:
                return i
        return -1

    def _continuation(self, seq: list[int]) -> list[int]:
        i = self._match(seq)
        if i < 0:
            return []
        full = self.table[i][0] + self.table[i][1]
        return full[len(seq):len(seq) + self.depth]

    @property
    def num_depths(self) -> int:
        return self.depth

    def _faulty(self, seq: list[int]) -> str | None:
        f = self.faults.get(self._match(seq)) if self.faults else None
        if f is None or len(seq) % int(f.get("every", 1)):
            return None
        return f["kind"]

    def _tree(self, seq: list[int], depth: int):
        """(tokens, parents, depths, scores) of one request's round, best-first."""
        cont = self._continuation(seq)[:depth]
        rng = random.Random(hash((self.shuffle, len(seq)))) if self.shuffle is not None \
            else None
        if rng is not None and self.random_depth and cont:
            cont = cont[:rng.randint(1, len(cont))]
        tokens, parents, depths, scores = [], [], [], []
        parent = -1
        for d, tok in enumerate(cont, start=1):
            right = rng.randrange(self.siblings) if rng is not None else 0
            chain = parent
            for j in range(self.siblings):
                offset = (j - right) % self.siblings     # 0 at the right child's slot
                if offset == 0:
                    chain = len(tokens)
                tokens.append(tok if offset == 0 else (tok + offset) % self.vocab_size)
                parents.append(parent)
                depths.append(d)
                scores.append(0.0)   # one score for all: the order is best-first
            parent = chain
        return tokens, parents, depths, scores

    def draft(self, rids, roots: torch.Tensor, num_depths: int | None = None) -> TreeBatch:
        budget = self.config.budget
        depth = self.depth if num_depths is None else min(num_depths, self.depth)
        trees = []
        for rid, root in zip(rids, roots.tolist()):
            seq = self.tokens.get(rid, []) + [int(root)]
            tokens, parents, depths, scores = (x[:budget] for x in self._tree(seq, depth))
            kind = self._faulty(seq)
            if kind == "raise":
                raise RuntimeError(f"injected drafter fault for request {rid}")
            if kind == "empty":
                tokens, parents, depths, scores = [], [], [], []
            elif kind == "nan" and scores:
                scores[0] = float("nan")
            elif kind == "bad_parent" and len(parents) > 1:
                parents[0] = len(parents) - 1
            elif kind == "bad_token" and tokens:
                tokens[0] = self.vocab_size + 7
            trees.append((tokens, parents, depths, scores))
        n = max(1, max(len(t[0]) for t in trees))
        tok = torch.zeros(len(trees), n, dtype=torch.long)
        dep = torch.zeros(len(trees), n, dtype=torch.long)
        par = torch.full((len(trees), n), -1, dtype=torch.long)
        sco = torch.full((len(trees), n), float("-inf"))
        for r, (t, p, d, sc) in enumerate(trees):
            m = len(t)
            if m:
                tok[r, :m], par[r, :m] = torch.tensor(t), torch.tensor(p)
                dep[r, :m], sco[r, :m] = torch.tensor(d), torch.tensor(sc)
        num = torch.tensor([len(t[0]) for t in trees], dtype=torch.long)
        return TreeBatch(tok, par, dep, sco, num)
