"""`LazyContext`: the drafter's context, extended only when it is about to be used.

Each committed row (prompt chunk, root, accepted node) extends its request's drafter context
(the target's aux hidden states through the drafter's fc and K/V projections). Under the
adaptive budget most steps may be plain, and a request may finish without drafting again
(at 16 requests on a 2-core CPU the budget keeps 90-96% of steps plain), so that work is
deferred: a committed row's token and features wait here until the request drafts
(`flush(rids)` just before the drafter pass). What the drafter sees when it drafts is exactly
what eager extension would have given it.

The rows waiting are bounded in bytes, for all requests together (`max_bytes`, default
`DEFAULT_MAX_BYTES`: features are [rows, layers x hidden] of the target's dtype, 25 KB a row
for Qwen3-4B in bf16, 11.5 KB for SmolLM2 in fp32): past it, `flush()` extends the requests
holding the most, in one batched call, until half the bound is left. A per-request cap of
32 rows (the first version) extended every prompt in the step after its prefill, and a
request that never drafted again paid for it anyway: 1.2 ms of a 60 ms step at 16 requests.

`length` / `trim` are the drafter's, counting the rows that wait: the runner's rewind after
preemption and its check for context the drafter never saw read the same numbers as before.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch

__all__ = ["LazyContext", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 128 * 2**20


class LazyContext:
    def __init__(self, drafter, max_bytes: int = DEFAULT_MAX_BYTES):
        self.drafter = drafter
        self.max_bytes = max_bytes
        # rid -> (tokens waiting, their feature tensors [T_k, F] in order, their bytes)
        self._pending: dict[Hashable, tuple[list[int], list[torch.Tensor], list[int]]] = {}
        self.bytes = 0          # the features waiting, all requests

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
            self.free(rid)
            self.drafter.trim(rid, length)
            return
        keep = length - have
        if keep > self.waiting(rid):
            raise ValueError(f"cannot trim request {rid!r} to {length} rows "
                             f"(it has {self.length(rid)})")
        tokens, feats, _ = self.free(rid)
        self.add(rid, tokens[:keep], torch.cat(feats)[:keep])

    def add(self, rid: Hashable, tokens: list[int], features: torch.Tensor) -> None:
        """Rows committed this step (features: [T, F]; the runner passes views of one tensor
        gathered per step: a view much smaller than that tensor is copied, so that what waits
        holds the memory it is counted for)."""
        if not tokens:
            return
        if 2 * features.nbytes < features.untyped_storage().nbytes():
            features = features.clone()
        waiting, feats, sizes = self._pending.setdefault(rid, ([], [], []))
        waiting.extend(tokens)
        feats.append(features)
        sizes.append(features.nbytes)
        self.bytes += features.nbytes

    def flush(self, rids: Iterable[Hashable] | None = None) -> None:
        """Extend the drafter with the rows waiting for `rids`, in one batched call; None:
        only if more than `max_bytes` wait, then those of the requests holding the most,
        until half of it is left."""
        if rids is None:
            if self.bytes <= self.max_bytes:
                return
            rids, left = [], self.bytes
            for rid, (_, _, sizes) in sorted(self._pending.items(),
                                             key=lambda item: -sum(item[1][2])):
                if left <= self.max_bytes // 2:
                    break
                rids.append(rid)
                left -= sum(sizes)
        batch = [(r, self.free(r)) for r in rids if r in self._pending]
        if not batch:
            return
        self.drafter.extend([r for r, _ in batch], [tokens for _, (tokens, _, _) in batch],
                            [feats[0] if len(feats) == 1 else torch.cat(feats)
                             for _, (_, feats, _) in batch])

    def free(self, rid: Hashable):
        """Drop what waits for `rid` (the drafter's own state is freed by the runner);
        returns it (tokens, features, bytes), or None."""
        entry = self._pending.pop(rid, None)
        if entry is not None:
            self.bytes -= sum(entry[2])
        return entry
