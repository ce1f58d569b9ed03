"""`LookupBranches`: the runner's per-request lookup indices (`vllm_dartree.tree.lookup`).

Each drafting request's index follows its committed tokens (`sync`, incremental; rebuilt
from the batch's token ids when the two disagree, e.g. after a preemption or a prefix-cache
hit); `find` gives this round's continuations (before drafting: the budget plans with their
`profile`, so a step can verify lookup nodes alone, with no drafter pass); `graft` puts
them onto the drafter's tree (if it ran) and orders the
result best-first by the nodes' acceptance estimates, so that the budget's cut (a prefix)
keeps the best nodes of either source. Indices are freed with their requests.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

from vllm_dartree.config import DARTreeConfig
from vllm_dartree.tree.lookup import (
    Continuation,
    LookupIndex,
    MergedTree,
    best_first,
    merge_branches,
    reorder,
)

__all__ = ["LookupBranches"]


class LookupBranches:
    def __init__(self, config: DARTreeConfig):
        self.config = config
        self.max_new = config.lookup_nodes()
        self._indices: dict[Hashable, LookupIndex] = {}
        self.rebuilds = 0   # indices rebuilt because they disagreed with the batch (preemption)

    def sync(self, rid: Hashable, token_ids: np.ndarray, start: int, count: int) -> None:
        """Request `rid` committed `token_ids[start:start + count]` (its whole row of token
        ids is `token_ids`)."""
        index = self._indices.get(rid)
        if index is None or len(index) != start:
            self.rebuilds += index is not None
            index = LookupIndex(self.config.lookup_min_n, self.config.lookup_max_n,
                                self.config.lookup_max_match)
            index.extend(token_ids[:start].tolist())
            self._indices[rid] = index
        index.extend(token_ids[start:start + count].tolist())

    def find(self, rid: Hashable, root: int) -> list[Continuation]:
        """This round's continuations for `rid`, whose pending token is `root`."""
        index = self._indices.get(rid)
        if index is None:
            return []
        return index.propose(root, self.max_new, self.config.lookup_candidates)

    def profile(self, found: list[Continuation]) -> tuple[np.ndarray, np.ndarray] | None:
        """(prior scores, depths) of the lookup nodes alone: what the budget plans with
        before the drafter has run (None: nothing found)."""
        if not found:
            return None
        tree = merge_branches([], [], [], [], found, self.max_new)
        return np.asarray(tree.scores), np.asarray(tree.depths)

    def graft(self, found: list[Continuation], tokens: Sequence[int], parents: np.ndarray,
              depths: np.ndarray, scores: np.ndarray,
              estimate: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
              ) -> MergedTree | None:
        """The drafter's tree with this round's lookup branches `found`, best-first by
        `estimate(scores, depths, sources)`; None when lookup found nothing."""
        if not found:
            return None
        tree = merge_branches(tokens, parents.tolist(), depths.tolist(), scores.tolist(),
                              found, self.max_new)
        p = estimate(np.asarray(tree.scores), np.asarray(tree.depths), np.asarray(tree.sources))
        return reorder(tree, best_first(p, tree.parents, tree.depths))

    def free(self, rid: Hashable) -> None:
        self._indices.pop(rid, None)

    def __len__(self) -> int:
        return len(self._indices)
