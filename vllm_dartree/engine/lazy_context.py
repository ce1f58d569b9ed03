"""`LazyContext`: the drafter's context, extended only when it is about to be used.

Each committed row (prompt chunk, root, accepted node) extends its request's drafter context
(the target's aux hidden states through the drafter's fc and K/V projections). Under the
adaptive budget most steps are plain, and a request may finish without drafting again, so
that work is deferred: a committed row's token and features wait here until the request
drafts (`flush(rids)` just before the drafter pass), or until `max_pending` rows wait (so
that the memory held per request stays bounded: at most `max_pending` rows of features,
flushed in one batched extension of every such request). What the drafter sees when it drafts
is exactly what eager extension would have given it.

`length` / `trim` are the drafter's, counting the rows that wait: the runner's rewind after
preemption and its check for context the drafter never saw read the same numbers as before.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch

__all__ = ["LazyContext"]


class LazyContext:
    def __init__(self, drafter, max_pending: int = 32):
        self.drafter = drafter
        self.max_pending = max_pending
        # rid -> (tokens waiting, their feature tensors [T_k, F] in order)
        self._pending: dict[Hashable, tuple[list[int], list[torch.Tensor]]] = {}

    def __len__(self) -> int:
        """Requests with rows waiting."""
        return len(self._pending)

    def waiting(self, rid: Hashable) -> int:
        entry = self._pending.get(rid)
        return 0 if entry is None else len(entry[0])

    def length(self, rid: Hashable) -> int:
        """Context rows of `rid`: the drafter's and those waiting."""
        return self.drafter.length(rid) + self.waiting(rid)

    def trim(self, rid: Hashable, length: int) -> None:
        """Cut `rid`'s context to `length` rows (a rewind: preemption, re-prefill)."""
        have = self.drafter.length(rid)
        if length <= have:
            self._pending.pop(rid, None)
            self.drafter.trim(rid, length)
            return
        keep = length - have
        if keep > self.waiting(rid):
            raise ValueError(f"cannot trim request {rid!r} to {length} rows "
                             f"(it has {self.length(rid)})")
        tokens, feats = self._pending[rid]
        self._pending[rid] = (tokens[:keep], [torch.cat(feats)[:keep]])

    def add(self, rid: Hashable, tokens: list[int], features: torch.Tensor) -> None:
        """Rows committed this step (features: [T, F]; the runner passes views of one tensor
        gathered per step, which stay alive until the rows are flushed)."""
        if not tokens:
            return
        waiting, feats = self._pending.setdefault(rid, ([], []))
        waiting.extend(tokens)
        feats.append(features)

    def flush(self, rids: Iterable[Hashable] | None = None) -> None:
        """Extend the drafter with the rows waiting for `rids` (None: the requests holding
        `max_pending` rows or more), in one batched call."""
        if rids is None:
            rids = [r for r, (tokens, _) in self._pending.items()
                    if len(tokens) >= self.max_pending]
        batch = [(r, self._pending.pop(r)) for r in rids if r in self._pending]
        if not batch:
            return
        self.drafter.extend([r for r, _ in batch], [tokens for _, (tokens, _) in batch],
                            [feats[0] if len(feats) == 1 else torch.cat(feats)
                             for _, (_, feats) in batch])

    def free(self, rid: Hashable) -> None:
        """Drop what waits for `rid` (the drafter's own state is freed by the runner)."""
        self._pending.pop(rid, None)
