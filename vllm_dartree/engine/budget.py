"""The budget controller: how many tree nodes each request verifies next step (0 = plain).

For a batch of R decoding requests, request i verifying the first n_i nodes of its
best-first tree expects `gain_i(n_i)` accepted tokens (the sum of its nodes' calibrated
acceptance, `engine.calibration`) and the step costs (`engine.costs`, measured online)

    T(n) = a + b * (R + sum n_i) + g * sum n_i + [any n_i > 0] * f
           + [depth > 0] * (c + sum_{n_i > 0} (d + e * depth))

(g: what a tree node costs on top of a decode row) where `depth` is the number of drafter depths computed (the deepest prefix chosen, the same
for the whole batched draft; 0 when every chosen node is a lookup node: the step verifies
trees, paying f for the masks, the walk and the compaction, but runs no drafter, so c and d
are not paid). The controller maximises the batch's tokens per second

    Theta(n) = (R + sum_i gain_i(n_i)) / T(n),

exactly over n_i in 0..B and depth in 1..D: for a fixed depth the cost is separable across
requests, so Dinkelbach's iteration (lambda <- Theta(n*), n* = argmax R + G(n) - lambda T(n))
converges to the exact optimum in a few rounds; the best depth wins. n = 0 everywhere is
always a candidate (a plain step, no drafter pass), so speculation is chosen only when the
estimates say it pays. Once the trees exist, `cut` keeps the prefix of each whose marginal
nodes are still worth their rows at the planned rate (the draft itself is paid by then).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

__all__ = ["BatchCosts", "Plan", "plan_budgets", "cut", "throughput"]


@dataclass(frozen=True, slots=True)
class BatchCosts:
    """The cost model's coefficients (seconds), read from `StepCosts` once per step."""
    step: float          # a: a plain step
    row: float           # b: one verified row
    tree_step: float     # f: a step that verifies trees (masks, walk, compaction)
    per_request: float   # d: one drafted request
    per_depth: float     # e: one drafted request, one depth
    draft: float = 0.0   # c: a step that runs the drafter (depth > 0)
    node: float = 0.0    # g: one verified tree node on top of its row (tree attention, walk)
    excess: float = 0.0  # h: one verified row past the knee (`engine.costs`: the hinge)
    knee: float = float("inf")   # K: rows a step verifies before h applies
    other_rows: int = 0  # rows of requests outside the plan (they count toward the knee)

    def allowance(self, requests: int) -> float:
        """Each of `requests` planned requests' share of the rows left before the knee (the
        plan prices the hinge per request: exact for one request, a fair split for more)."""
        if not np.isfinite(self.knee) or requests == 0:
            return float("inf")
        return max(0.0, self.knee - requests - self.other_rows) / requests

    @property
    def node_row(self) -> float:
        """b + g: what one more verified tree node costs."""
        return self.row + self.node


@dataclass(frozen=True, slots=True)
class Plan:
    nodes: np.ndarray    # [R] int64, planned verified nodes per request (0 = no tree)
    depth: int           # drafter depths to compute (0 = no drafter pass)
    rate: float          # planned tokens per second (lambda*)


def throughput(gains: np.ndarray, depths: np.ndarray, nodes: np.ndarray,
               costs: BatchCosts, depth: int | None = None) -> float:
    """Theta(n) for an allocation (gains, depths: [R, B + 1] prefix curves, nodes: [R]);
    `depth` overrides the drafted depth (default: the deepest chosen prefix)."""
    if gains.shape[0] == 0:      # no request: no tokens
        return 0.0
    nodes = np.asarray(nodes)[None, :]
    at_cap, own = _rates(gains, depths, nodes, costs, np.array([depth or 0]))
    return float(own[0] if depth is None else at_cap[0])


def _best_for_depth(gains, depths, depth: int, costs: BatchCosts, lam: float) -> np.ndarray:
    """argmax_n R + G(n) - lam * T(n) with every prefix depth <= depth (costed at depth)."""
    b = gains.shape[1] - 1
    n = np.arange(b + 1)
    per_request = costs.per_request + costs.per_depth * depth if depth > 0 else 0.0
    fixed = costs.tree_step + (costs.draft if depth > 0 else 0.0)
    cost = costs.node_row * n + np.where(n > 0, per_request, 0.0)
    if costs.excess:
        cost = cost + costs.excess * np.maximum(0.0, n - costs.allowance(gains.shape[0]))
    value = gains - lam * cost[None, :]
    value = np.where(depths <= depth, value, -np.inf)
    value[:, 0] = 0.0
    best = value.argmax(axis=1)
    if value[np.arange(len(best)), best].sum() <= lam * fixed:
        return np.zeros_like(best)          # the step's fixed tree costs are not earned
    return best


def plan_budgets(gains: np.ndarray, depths: np.ndarray, costs: BatchCosts,
                 max_iters: int = 30) -> Plan:
    """The exact optimum of Theta over n_i in 0..B and the drafted depth.

    gains: [R, B + 1] float, gains[i, n] = expected accepted tokens of request i's first n
    nodes (gains[:, 0] = 0); depths: [R, B + 1] int, the depth of that prefix (0 at n = 0).
    Costing every allocation at a depth cap >= its own depth only overestimates it, and the
    optimum is costed exactly under the cap equal to its own depth: the best over caps of
    each cap's Dinkelbach optimum is the optimum. The caps' iterations run side by side,
    one array operation for all of them (`_plan_caps`: 16 caps one after the other cost
    0.4 ms a step in Python).
    """
    r = gains.shape[0]
    plain = np.zeros(r, dtype=np.int64)
    best_rate = throughput(gains, depths, plain, costs)
    if r == 0 or gains.shape[1] == 1:
        return Plan(plain, 0, best_rate)
    # Most steps are plain: when no allocation earns its cost even with drafting free and
    # every depth allowed (a relaxation of every cap below), every cap's first Dinkelbach
    # step returns the plain step, so one check decides (exactly the loop's answer).
    free_draft = replace(costs, per_request=0.0, per_depth=0.0, draft=0.0)
    if not _best_for_depth(gains, depths, int(depths.max()), free_draft, best_rate).any():
        return Plan(plain, 0, best_rate)
    best_nodes, best_rate = _plan_caps(gains, depths, costs, best_rate, max_iters)
    idx = np.arange(r)
    depth = int(depths[idx, best_nodes].max()) if best_nodes.any() else 0
    return Plan(best_nodes.astype(np.int64), depth, best_rate)


def _plan_caps(gains, depths, costs: BatchCosts, plain_rate: float, max_iters: int):
    """Dinkelbach's iteration for every depth cap 0..D at once (cap 0: prefixes that need
    no drafter depth, lookup nodes alone): per cap the sequence of `_best_for_depth` and
    `throughput`, and the best allocation found in the order cap by cap, iteration by
    iteration (ties to the first, as one cap after the other would find them)."""
    r, width = gains.shape
    caps = np.arange(int(depths.max()) + 1)
    n = np.arange(width)
    allowance = costs.allowance(r)
    per_request = np.where(caps > 0, costs.per_request + costs.per_depth * caps, 0.0)
    fixed = costs.tree_step + np.where(caps > 0, costs.draft, 0.0)              # [C]
    cost = costs.node_row * n[None, :] + np.where(n[None, :] > 0, per_request[:, None], 0.0)
    if costs.excess:
        cost = cost + costs.excess * np.maximum(0.0, n - allowance)[None, :]
    allowed = depths[None, :, :] <= caps[:, None, None]                            # [C, R, W]
    lam = np.full(len(caps), plain_rate)
    active = np.ones(len(caps), dtype=bool)
    found = []      # (cap, iteration, true rate, nodes)
    for it in range(max_iters):
        value = gains[None] - lam[:, None, None] * cost[:, None, :]
        value = np.where(allowed, value, -np.inf)
        value[:, :, 0] = 0.0
        best = value.argmax(axis=2)                                               # [C, R]
        earned = np.take_along_axis(value, best[:, :, None], 2)[:, :, 0].sum(axis=1)
        best[earned <= lam * fixed] = 0
        modelled, true = _rates(gains, depths, best, costs, caps)
        for c in np.flatnonzero(active):
            found.append((int(c), it, float(true[c]), best[c]))
            if modelled[c] <= lam[c] * (1 + 1e-12):
                active[c] = False
            else:
                lam[c] = modelled[c]
        if not active.any():
            break
    best_nodes, best_rate = np.zeros(r, dtype=np.int64), plain_rate
    for _, _, true, nodes in sorted(found, key=lambda f: (f[0], f[1])):
        if true > best_rate + 1e-12:
            best_nodes, best_rate = nodes, true
    return best_nodes, best_rate


def _rates(gains, depths, nodes: np.ndarray, costs: BatchCosts, caps: np.ndarray):
    """Theta of allocations nodes [C, R] (`throughput`), costed at the drafted depth caps
    [C] (modelled) and at their own deepest prefix (true); an allocation without nodes
    pays no tree costs."""
    r = gains.shape[0]
    idx = np.arange(r)
    tokens = r + gains[idx[None, :], nodes].sum(axis=1)
    total = nodes.sum(axis=1)
    seconds = costs.step + costs.row * r + costs.node_row * total
    if costs.excess:
        seconds = seconds + costs.excess * np.maximum(0.0, r + costs.other_rows + total
                                                      - costs.knee)
    drafted = nodes > 0
    any_tree = drafted.any(axis=1)
    own = depths[idx[None, :], nodes].max(axis=1)
    count = drafted.sum(axis=1)

    def with_depth(depth):
        extra = costs.tree_step + np.where(
            depth > 0, costs.draft + count * (costs.per_request + costs.per_depth * depth), 0.0)
        return tokens / (seconds + np.where(any_tree, extra, 0.0))
    return with_depth(np.where(any_tree, caps, 0)), with_depth(own)


def cut(gains: np.ndarray, row_cost: float, rate: float, limit: np.ndarray,
        excess: float = 0.0, allowance: float = float("inf")) -> np.ndarray:
    """Per request, the prefix length n <= limit_i maximising gain_i(n) - rate * cost(n),
    cost(n) = row_cost * n + excess * max(0, n - allowance) (the drafting is paid; a node
    stays if it earns its row at the planned rate)."""
    b = gains.shape[1] - 1
    n = np.arange(b + 1)
    cost = row_cost * n + (excess * np.maximum(0.0, n - allowance) if excess else 0.0)
    value = gains - rate * cost[None, :]
    value = np.where(n[None, :] <= limit[:, None], value, -np.inf)
    return value.argmax(axis=1).astype(np.int64)
