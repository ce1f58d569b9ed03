"""Calibrated acceptance: P(a verified node lies on the accepted path | what the drafter said).

Every tree walk labels the verified nodes: 1 on the accepted path, 0 elsewhere. The drafter's
own opinion of a node is its path log-probability `score` and its `depth`; drafters are
rarely calibrated (a small drafter is over-confident on fresh text and under-confident on
repeated text), so the budget controller never uses `exp(score)` directly. Instead:

- nodes fall into bins (depth group x score bin); each bin keeps decayed counts of hits and
  visits (decay per update, so the estimate follows a changing workload);
- a bin's estimate is (hits + w * prior) / (visits + w) with the drafter's own `exp(score)`
  as the prior of weight w (a fresh engine trusts the drafter until it has seen walks);
- within a depth group the estimates are made non-decreasing in score by weighted isotonic
  regression (pool-adjacent-violators), and non-increasing with depth group; a bin no walk
  has visited holds only its prior and constrains neither fit;
- a request whose acceptance differs from the pool's carries a correction factor
  (decayed observed / predicted accepted length, clamped), applied to its nodes.

Expected accepted length of a tree prefix = the sum of its nodes' probabilities (a node is
accepted only with its whole path, so the sum over nodes is the expected path length).
One calibrator per temperature class (greedy / sampled) is kept by the runner.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

__all__ = ["AcceptanceCalibrator", "isotonic_increasing"]

_DEPTH_EDGES = np.array([1, 2, 3, 4, 6, 9, 13])        # group g: depths [edge g, edge g+1)
_SCORE_EDGES = np.array([-8.0, -6.0, -5.0, -4.0, -3.0, -2.5, -2.0, -1.5, -1.0, -0.7, -0.45,
                         -0.25, -0.1])                 # bin s: scores in [edge s-1, edge s)


def isotonic_increasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of `values` (pool adjacent violators)."""
    blocks: list[list[float]] = []        # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            total = w1 + w2
            mean = (m1 * w1 + m2 * w2) / total if total > 0 else (m1 + m2) / 2
            blocks.append([mean, total, c1 + c2])
    return np.concatenate([np.full(c, m) for m, _, c in blocks])


class AcceptanceCalibrator:
    """Online, binned, isotonic P(accepted | score, depth), with per-request corrections."""

    def __init__(self, decay: float = 0.995, prior_weight: float = 2.0,
                 request_decay: float = 0.8, correction_range: tuple[float, float] = (0.25, 4.0)):
        shape = (len(_DEPTH_EDGES), len(_SCORE_EDGES) + 1)
        self.hits = np.zeros(shape)
        self.visits = np.zeros(shape)
        self.prior_mass = np.zeros(shape)     # decayed sum of exp(score) of the visits
        self.decay, self.prior_weight = decay, prior_weight
        self.request_decay, self.correction_range = request_decay, correction_range
        self._req: dict[Hashable, tuple[float, float]] = {}   # rid -> (observed, predicted)
        self._table: np.ndarray | None = None

    @staticmethod
    def _bins(scores: np.ndarray, depths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = np.clip(np.searchsorted(_DEPTH_EDGES, depths, side="right") - 1, 0, None)
        s = np.searchsorted(_SCORE_EDGES, scores, side="right")
        return g, s

    def table(self) -> np.ndarray:
        """[depth groups, score bins] calibrated probabilities: non-decreasing in score, and
        no deeper bin above a shallower visited one."""
        if self._table is None:
            prior = np.where(self.visits > 0, self.prior_mass / np.maximum(self.visits, 1e-12),
                             self._bin_centres())
            w = self.prior_weight
            raw = (self.hits + w * prior) / (self.visits + w)
            # a bin nobody visited carries only its prior: it must not pull visited bins
            # down (or up); the fit lifts it to its neighbours instead
            table = np.stack([isotonic_increasing(row, np.where(v > 1e-9, v + w, 1e-3))
                              for row, v in zip(raw, self.visits)])
            # deeper groups never higher than a shallower group's *visited* bin (an empty
            # bin holds only its prior and bounds nothing)
            bound = np.full(table.shape[1], np.inf)
            for g in range(table.shape[0]):
                table[g] = np.minimum(table[g], bound)
                bound = np.minimum(bound, np.where(self.visits[g] > 1e-9, table[g], np.inf))
            self._table = table
        return self._table

    @staticmethod
    def _bin_centres() -> np.ndarray:
        edges = np.concatenate([[-10.0], _SCORE_EDGES, [0.0]])
        centres = np.exp((edges[:-1] + edges[1:]) / 2)
        return np.broadcast_to(centres, (len(_DEPTH_EDGES), len(centres))).copy()

    def predict(self, scores: np.ndarray, depths: np.ndarray,
                rid: Hashable | None = None) -> np.ndarray:
        """Calibrated probabilities of nodes (scores, depths: [M]); `rid` adds its correction."""
        g, s = self._bins(np.asarray(scores, dtype=np.float64), np.asarray(depths))
        p = self.table()[g, s]
        if rid is not None:
            p = np.minimum(p * self.correction(rid), 1.0)
        return p

    def correction(self, rid: Hashable) -> float:
        observed, predicted = self._req.get(rid, (0.0, 0.0))
        lo, hi = self.correction_range
        return float(np.clip((observed + 1.0) / (predicted + 1.0), lo, hi))

    def update(self, scores: np.ndarray, depths: np.ndarray, accepted: np.ndarray,
               rid: Hashable | None = None) -> tuple[float, float]:
        """Add one verified tree: node scores, depths, accepted [M] bool (1 = on the path).

        Returns (predicted, observed) accepted length of this tree, the prediction made
        before the update (with the request's correction): what the metrics compare.
        """
        scores = np.asarray(scores, dtype=np.float64)
        predicted = float(self.predict(scores, depths, rid).sum()) if len(scores) else 0.0
        observed = float(np.count_nonzero(accepted))
        self.hits *= self.decay
        self.visits *= self.decay
        self.prior_mass *= self.decay
        if len(scores):
            g, s = self._bins(scores, np.asarray(depths))
            np.add.at(self.hits, (g, s), np.asarray(accepted, dtype=np.float64))
            np.add.at(self.visits, (g, s), 1.0)
            np.add.at(self.prior_mass, (g, s), np.exp(scores))
            self._table = None
        if rid is not None:
            pool = predicted / self.correction(rid)     # the pool's view of this tree
            obs, pred = self._req.get(rid, (0.0, 0.0))
            d = self.request_decay
            self._req[rid] = (d * obs + observed, d * pred + pool)
        return predicted, observed

    def free(self, rid: Hashable) -> None:
        self._req.pop(rid, None)

    @property
    def request_ids(self) -> set[Hashable]:
        """Requests holding a correction (freed with `free`)."""
        return set(self._req)
