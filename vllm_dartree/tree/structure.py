"""Flattened tree batches: the data every builder returns and every verifier consumes.

Layout, for R requests with N node slots each (worked example, R = 1, N = 4):

    root ─ a(0) ─ c(2)
         └ b(1) ─ d(3)          tokens  = [a, b, c, d]
                                parents = [-1, -1, 0, 1]     (-1 = root; parents[i] < i)
                                depths  = [1, 1, 2, 2]

The verification input is `[root] + nodes` (length 1 + N): node i sits at column i + 1, its
position is `p0 + depths[i]`, and its attention row sees the committed context, its
ancestors and itself (the ancestor mask below). Slots past `num_nodes[r]` are padding:
token 0, parent -1, depth 0, score -inf; any prefix of the order is itself a valid tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "TreeBatch",
    "ancestor_mask",
    "ancestor_bitmask",
    "best_first_order",
    "bitmask_to_mask",
    "mask_to_bitmask",
    "tree_positions",
    "truncate",
    "valid_node_mask",
]


@dataclass(frozen=True, slots=True)
class TreeBatch:
    tokens: torch.Tensor     # [R, N] int64, draft token of each node (0 on padding)
    parents: torch.Tensor    # [R, N] int64, parent node index, -1 = root; parents[r, i] < i
    depths: torch.Tensor     # [R, N] int64, 1 for children of the root (0 on padding)
    scores: torch.Tensor     # [R, N] float32, path log-probability, no depth bonus (-inf pad)
    num_nodes: torch.Tensor  # [R] int64, valid nodes are the prefix [0, num_nodes[r])

    @property
    def num_requests(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    def narrow(self, num: int) -> TreeBatch:
        """The first `num` node slots of every request (host-side engines with dynamic shapes)."""
        return TreeBatch(self.tokens[:, :num], self.parents[:, :num], self.depths[:, :num],
                         self.scores[:, :num], torch.clamp(self.num_nodes, max=num))

    def request(self, r: int) -> TreeBatch:
        """The tree of request r alone, as a batch of one (for tests and printing)."""
        sl = slice(r, r + 1)
        return TreeBatch(self.tokens[sl], self.parents[sl], self.depths[sl],
                         self.scores[sl], self.num_nodes[sl])


def valid_node_mask(tree: TreeBatch) -> torch.Tensor:
    """[R, N] bool: True on the first num_nodes[r] slots."""
    slots = torch.arange(tree.max_nodes, device=tree.tokens.device)
    return slots[None, :] < tree.num_nodes[:, None]


def ancestor_mask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Ancestor-or-self mask of `[root] + nodes` by pointer hops (torch reference).

    parents: [R, N] int64 (-1 = root). Returns [R, 1 + N, 1 + N] bool where row i + 1
    (node i) is True exactly at the root, the ancestors of node i and node i itself; row 0
    (the root) sees only itself. `max_depth` bounds the hops (default N): one gather and one
    scatter per level, no host synchronisation.
    """
    num_req, num_nodes = parents.shape
    hops = num_nodes if max_depth is None else max_depth
    cols = torch.arange(1 + num_nodes, device=parents.device)
    # parent of every column of [root] + nodes; the root is its own parent (a fixed point).
    up = torch.cat([parents.new_zeros(num_req, 1), parents + 1], dim=1)  # [R, 1+N]
    mask = torch.zeros(num_req, 1 + num_nodes, 1 + num_nodes, dtype=torch.bool,
                       device=parents.device)
    cur = cols.expand(num_req, -1).clone()                                # [R, 1+N]
    mask.scatter_(2, cur.unsqueeze(-1), True)
    for _ in range(hops):
        cur = torch.gather(up, 1, cur)
        mask.scatter_(2, cur.unsqueeze(-1), True)
    return mask


def ancestor_bitmask(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """The ancestor mask packed in int32 words: bit (j % 32) of word j // 32 is column j.

    Returns [R, 1 + N, ceil((1 + N) / 32)] int32 (two's complement: bit 31 makes a word
    negative). The torch reference of `csrc_triton.tree_mask`.
    """
    return mask_to_bitmask(ancestor_mask(parents, max_depth))


def mask_to_bitmask(mask: torch.Tensor) -> torch.Tensor:
    """[..., C] bool -> [..., ceil(C / 32)] int32 with bit j % 32 of word j // 32 = column j."""
    cols = mask.shape[-1]
    words = (cols + 31) // 32
    padded = torch.nn.functional.pad(mask, (0, words * 32 - cols)).to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(
        32, device=mask.device)
    packed = (padded.unflatten(-1, (words, 32)) * weights).sum(-1)   # [..., words] < 2**32
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def bitmask_to_mask(bitmask: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Inverse of `mask_to_bitmask`: [..., words] int32 -> [..., num_cols] bool."""
    cols = torch.arange(num_cols, device=bitmask.device)
    words = bitmask.to(torch.int64)[..., cols // 32]
    return ((words >> (cols % 32)) & 1).bool()


def tree_positions(tree: TreeBatch, p0: torch.Tensor) -> torch.Tensor:
    """Positions of `[root] + nodes`: [R, 1 + N] int64 = p0 + depth (root at p0).

    p0: [R] int64, the position of the root (the last committed token).
    """
    depths = torch.cat([tree.depths.new_zeros(tree.num_requests, 1), tree.depths], dim=1)
    return p0[:, None] + depths


def truncate(tree: TreeBatch, max_nodes: torch.Tensor | int) -> TreeBatch:
    """Keep at most `max_nodes` ([R] or an int) nodes per request: a prefix of the order.

    Static shapes: N stays the same, the dropped slots become padding. Because parents
    precede children, every prefix is ancestor-closed.
    """
    num_nodes = torch.clamp(tree.num_nodes, max=max_nodes) if isinstance(max_nodes, int) \
        else torch.minimum(tree.num_nodes, max_nodes)
    slots = torch.arange(tree.max_nodes, device=tree.tokens.device)
    keep = slots[None, :] < num_nodes[:, None]
    return TreeBatch(
        tokens=torch.where(keep, tree.tokens, 0),
        parents=torch.where(keep, tree.parents, -1),
        depths=torch.where(keep, tree.depths, 0),
        scores=torch.where(keep, tree.scores, float("-inf")),
        num_nodes=num_nodes,
    )


def best_first_order(tree: TreeBatch, depth_bonus: float = 0.0) -> TreeBatch:
    """The same trees, nodes in descending `score + depth_bonus * depth` (padding last).

    With depth_bonus <= 0 a child never outranks its parent (its score adds a log q <= 0),
    and a stable sort keeps ties in the old topological order, so the result is topological
    and every prefix of n nodes is the best tree of n nodes (Lemma 1): whoever cuts the
    tree (the budget controller, the scheduler, max_model_len) keeps the most likely nodes.
    """
    num_req, n = tree.tokens.shape
    slots = torch.arange(n, device=tree.tokens.device)
    valid = slots[None, :] < tree.num_nodes[:, None]
    key = tree.scores + depth_bonus * tree.depths.to(tree.scores.dtype)
    key = torch.where(valid, key, float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices     # [R, N]
    remap = order.new_full((num_req, 1 + n), -1)          # old index + 1 -> new index
    remap.scatter_(1, order + 1, slots.expand(num_req, -1))
    pick = lambda t: torch.gather(t, 1, order)  # noqa: E731
    parents = torch.gather(remap, 1, pick(tree.parents) + 1)
    return TreeBatch(pick(tree.tokens), torch.where(pick(valid), parents, -1),
                     pick(tree.depths), pick(tree.scores), tree.num_nodes)
