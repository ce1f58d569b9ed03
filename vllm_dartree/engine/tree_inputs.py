"""What a step's trees look like to the runner, and the rows they become (stage 2 of a round).

`StoredTree` is a proposed tree kept until the scheduler hands its prefix back; `StepTrees`
what one engine step scheduled per batch row; `tree_rows` the step's ancestor bitmasks and
depth positions for the whole batch, built on the device in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_dartree import ops

__all__ = ["StoredTree", "StepTrees", "tree_rows", "is_chain"]


def is_chain(parents: torch.Tensor) -> bool:
    """Whether a tree's nodes (parents [n], -1 = the root) form one path: node j's parent is
    node j - 1. Such a tree's rows are a chain's: positions p0 + 1 .. p0 + n and the causal
    mask, so it is verified as causal rows (vLLM's own attention, no mask)."""
    n = int(parents.shape[0])
    return bool(torch.equal(parents.cpu(), torch.arange(-1, n - 1, dtype=parents.dtype)))


def tree_rows(trees: list[tuple[torch.Tensor, torch.Tensor] | None], starts: np.ndarray,
              rows: np.ndarray, p0: np.ndarray, device: torch.device | str,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One step's tree inputs for the whole batch, built on `device` in one pass.

    trees[i]: request i's (parents [n], depths [n]) when its rows are `[root] + n nodes`
    (None: causal rows); starts / rows / p0: its first flattened row, its row count and its
    root's position. Returns (tree_mask [R, Qmax, ceil(Qmax / 32)] int32, the ancestor
    bitmask of every tree request's window and zeros elsewhere; index [M] and positions
    [M] int64, the flattened node rows and their positions p0 + depth, for an in-place
    `positions.index_copy_`), or None when no request has a tree. One host -> device copy
    and one mask launch (`ops.ancestor_bitmask`, Triton on CUDA); nothing is read back.
    """
    ids = [i for i, t in enumerate(trees) if t is not None]
    if not ids:
        return None
    counts = [int(trees[i][0].shape[0]) for i in ids]
    width = max(counts)
    parents = torch.full((len(ids), width), -1, dtype=torch.int64)
    index_parts, position_parts = [], []
    for j, (i, n) in enumerate(zip(ids, counts)):
        tree_parents, tree_depths = trees[i]
        parents[j, :n] = tree_parents.cpu()
        index_parts.append(int(starts[i]) + 1 + torch.arange(n))
        position_parts.append(int(p0[i]) + tree_depths.cpu().long())
    live = torch.arange(1 + width)[None, :] <= torch.tensor(counts)[:, None]   # [Rt, 1 + W]
    q_max = int(np.max(rows))
    words = (q_max + 31) // 32
    host = (parents, live, torch.tensor(ids), torch.cat(index_parts), torch.cat(position_parts))
    parents, live, ids_t, index, positions = (t.to(device, non_blocking=True) for t in host)
    bits = ops.ancestor_bitmask(parents)                               # [Rt, 1 + W, words_W]
    mask = torch.zeros(len(trees), q_max, words, dtype=torch.int32, device=device)
    mask[ids_t, :1 + width, :bits.shape[-1]] = bits * live[..., None]
    return mask, index, positions


@dataclass
class StoredTree:
    tokens: list[int]
    parents: torch.Tensor   # [N] int64, -1 = root
    depths: torch.Tensor    # [N] int64
    scores: np.ndarray | None = None   # [N] float64, the drafter's path log-probabilities
    sources: np.ndarray | None = None  # [N] tree.lookup.DRAFTER / LOOKUP / BOTH (None: drafter)


@dataclass
class StepTrees:
    """What one engine step scheduled, per batch row."""
    req_ids: list[str]
    starts: np.ndarray          # first flattened row of each request
    rows: np.ndarray            # scheduled rows
    p0: np.ndarray              # position of the first scheduled row
    drafts: list[list[int]]     # scheduled draft tokens
    trees: list[StoredTree | None]
    is_tree: list[bool] = field(default_factory=list)
    decode_only: bool = False   # every request decodes (no prompt chunk): a step to time
    tree_mask: torch.Tensor | None = None
    accepted: list[list[int]] | None = None   # accepted node indices, set by _sample
    confidence: np.ndarray | None = None      # [R] target's top probability at each
    #                                           request's last sampled row, set by _sample
