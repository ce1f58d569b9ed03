"""`TreeBudget`: the runner's adaptive budget, one per worker (calibration + costs + plan).

Per step the runner asks, before drafting, `plan(rids, greedy)`: how many nodes each
request should verify next step and how many drafter depths that needs (0 for every
request = a plain step: the drafter is not run at all). The prediction for a request is
its last tree (the largest recent tree for a new request) re-scored by the current
calibrator.
After drafting, `cut` gives each fresh tree the prefix whose nodes earn their rows at the
planned rate. After the target's walk, `observe_walk` labels the verified nodes (the
calibration's data) and the runner reports step and draft timings (`observe_step`,
`observe_draft`: the cost model's data). Predictions are scaled down by the recent ratio of
accepted to predicted tokens of the verified trees (`shrink`, per batch size class): the
plan picks the trees predicted best, so the estimates' noise is selected upward, the more so
in a larger batch.

So that the estimates never freeze while every step is plain, one request in turn drafts
and verifies a small tree (alternately 2 and 4 nodes, so that a row's cost can be told from
a tree step's) after a run of plain steps. The run starts at 16 steps and doubles, up to
256, each time an exploration does not convince the plan to draft by itself, so a drafter
that does not pay costs about 1% of the steps; any step the plan drafts resets it.

`VLLM_DARTREE_PLAIN=1` makes every step plain and never explores: plain decoding through
the plugin's worker and attention, to measure what the plugin itself costs.
`VLLM_DARTREE_CONFIDENCE=1` (off by default) also scales predictions by the target's
confidence at each request's last sampled row (`confidence_factor`): an experiment that has
not paid on this machine (docs/engine.md, "The target's confidence").
`VLLM_DARTREE_COMPETE=0` plans a request's drafter nodes beside this round's lookup branches
as if they did not compete for the root's one accepted child (`_compete`): for comparison.
`VLLM_DARTREE_TRACE=FILE` writes every plan, draft, walk and step timing to FILE
(`engine.trace`, which also reads one back: planned against realized speed-ups).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from vllm_dartree.engine.budget import BatchCosts, Plan, cut, plan_budgets, throughput
from vllm_dartree.engine.calibration import AcceptanceCalibrator
from vllm_dartree.engine.costs import StepCosts
from vllm_dartree.engine.trace import BudgetTrace
from vllm_dartree.tree.lookup import BOTH, DRAFTER, LOOKUP

__all__ = ["TreeBudget", "BudgetPlan", "batch_class"]

logger = logging.getLogger("vllm.dartree")


BIAS_DECAY = 0.97   # per verified tree: the selection bias follows the last ~30 trees
BIAS_PRIOR = 3.0    # accepted tokens: a batch class's own record outweighs the pool's soon


def batch_class(running: int) -> int:
    """The selection bias is kept per batch size, since the plan chooses among more trees in
    a larger batch (and picks the most over-predicted ones): 1, 2-4, 5-8, 9+ requests."""
    return 0 if running <= 1 else 1 if running <= 4 else 2 if running <= 8 else 3


NUM_BATCH_CLASSES = 4

# The target's confidence at a request's last sampled row (the probability of its most
# likely token there), binned: a per-step signal that a request's last tree (what the plan
# predicts from) and even the fresh drafter scores (what the cut sees) miss. Measured on 24
# demo-set prompts at one request (the third drafter): trees verified after a row below 0.3
# accepted 0.26 of their calibrated prediction (0.29 tokens), after rows above 0.85 1.1-1.3
# of it (1.8 tokens). Each bin keeps the decayed observed / predicted accepted tokens of its
# trees; a prediction is scaled by its bin's ratio over the class's overall one. Opt-in
# (`VLLM_DARTREE_CONFIDENCE=1`): in two benchmark runs it moved tokens/s by -8% to +7%,
# within the runs' noise (fewer losing trees at low confidence, few new good ones).
CONF_EDGES = np.array([0.3, 0.5, 0.7, 0.85, 0.95])
NUM_CONF_BINS = len(CONF_EDGES) + 1
CONF_DECAY = 0.98     # per verified tree of the bin: its last ~50 trees
CONF_PRIOR = 3.0      # accepted tokens at the overall ratio: a bin's record outweighs it soon
CONF_RANGE = (0.25, 2.0)


# A request's last tree says how sure the drafter was at the position it drafted from; the
# next tree drafts from a later one. Planned from the last tree alone, one unsure tree kept a
# request plain until lookup found something or an exploration came round (at one request
# on the demo prompts: 71% plain steps, 1.32x plain decoding, while a 4-node tree every
# step read 1.61x in the same run, its trees accepting 0.9 tokens each on average). So the
# drafter nodes' predictions are blended, rank by rank, with the decayed average of the
# recent fresh trees' (per temperature class): the request's own weight is PROFILE_WEIGHT
# in the plan right after its tree, halved with every plan since (a stale profile). Lookup
# nodes found this round are this round's own information and keep their estimates. The
# average is re-estimated at every plan from the last POOL_TREES fresh trees with the
# current calibration (an average of old estimates would lag the calibration).
PROFILE_WEIGHT = 0.5
POOL_TREES = 8
# past this many plans a profile weighs PROFILE_WEIGHT / 2**AGE_CAP (< 1e-5) in the blend:
# its curve is the pool's and stays as it is (`TreeBudget._curves` keeps it)
AGE_CAP = 16


def _compete(p: np.ndarray, owner: np.ndarray, sources: np.ndarray, depths: np.ndarray,
             r: int) -> np.ndarray:
    """A request's predicted drafter nodes (grouped by `owner` [M], R requests) scaled by
    the chance that this round's lookup branches miss at the root, 1 - min(1, sum of p over
    its lookup nodes at depth 1): one child of the root is accepted, so where lookup's first
    token is likely right, the drafter's nodes beside it are likely not (and where the
    drafter agrees with it, the merged tree shares the node: it adds nothing either). Summed
    as if independent, a confident lookup match made the drafter's pass look worth its cost
    on top of it. (Deeper drafter nodes that continue the lookup path are undercounted: a
    conservative estimate, like the curves'.)"""
    first = (sources == LOOKUP) & (depths == 1)
    if not first.any():
        return p
    miss = 1.0 - np.minimum(np.bincount(owner[first], weights=p[first], minlength=r), 1.0)
    return np.where(sources != LOOKUP, p * miss[owner], p)


# After this many plain plans in a row only every 2nd step plans, after the second number
# every 4th (`TreeBudget.skip`); any tree resets it. At 16 requests on a 2-core CPU the plan
# and lookup cost 1.3-1.9 ms of a 40 ms step while 70-95% of the plans came out plain.
SKIP_AFTER = (8, 32)


def _growth(depth: int, whole: bool) -> int:
    """Depths to draft past the plan's `depth`: one, or half as many again (at least one)
    when the plan takes a whole predicted tree (`whole`: its curve ends there, the tree it
    predicts from was too small to say what more would earn). A tree grows only as deep as
    it was drafted, so with one depth a step, a drafter that is right (the oracle: 2 nodes a
    depth, half of them accepted) verified 20 nodes a tree where 32 paid (4.48x plain
    decoding against a fixed 32-node tree's 5.18x at one request)."""
    return max(1, depth // 2) if whole else 1


def confidence_bin(confidence: float) -> int:
    """0 (below 0.3) .. 5 (0.95 and above)."""
    return int(np.searchsorted(CONF_EDGES, confidence, side="right"))


@dataclass(frozen=True, slots=True)
class BudgetPlan:
    nodes: np.ndarray        # [R] int64, nodes each request may verify (0 = no tree)
    depth: int               # drafter depths to compute (0 = no drafter pass)
    rate: float              # planned tokens per second of the batch
    explore: np.ndarray      # [R] bool, requests that verify `explore_nodes` whatever the cut
    factor: np.ndarray | None = None   # [R] confidence factors the plan used (None: all 1)


def _curve(p: np.ndarray, depths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefix curves of a best-first tree: gains [width + 1] (expected accepted tokens of the
    first n nodes, marginals made non-increasing: a conservative estimate) and the drafter
    depths the prefix needs [width + 1] (`depths`: 0 for nodes the drafter did not propose);
    padded past the tree with no gain and its last depth."""
    m = min(len(p), width)
    gains, deep = np.zeros(width + 1), np.zeros(width + 1, dtype=np.int64)
    if m:
        gains[1:m + 1] = np.cumsum(np.minimum.accumulate(p[:m]))
        deep[1:m + 1] = np.maximum.accumulate(depths[:m])
        gains[m + 1:], deep[m + 1:] = gains[m], deep[m]
    return gains, deep


def _curves_sorted(p: np.ndarray, need: np.ndarray, sizes: np.ndarray,
                   width: int) -> tuple[np.ndarray, np.ndarray]:
    """`_curve` of every request at once: p and need [sum(sizes)], request by request, each
    request's nodes sorted by descending p (so its marginals are already non-increasing);
    sizes [R]. Returns gains [R, width + 1] and depths [R, width + 1]."""
    r = len(sizes)
    starts = np.cumsum(sizes) - sizes
    pos = np.arange(len(p)) - np.repeat(starts, sizes)      # rank within its request
    keep = pos < width
    owner = np.repeat(np.arange(r), sizes)[keep]
    col = pos[keep] + 1
    gains = np.zeros((r, width + 1))
    deep = np.zeros((r, width + 1), dtype=np.int64)
    # within a request: running sums of p and running maxima of the depths; across
    # requests the depth maximum restarts (each request's depths offset above the last's)
    pk, nk = p[keep], need[keep].astype(np.int64)
    sums = np.cumsum(pk)
    kept = np.bincount(owner, minlength=r)
    first = np.cumsum(kept) - kept
    base = np.concatenate([[0.0], sums])[first]
    gains[owner, col] = sums - base[owner]
    span = int(nk.max(initial=0)) + 1
    deep[owner, col] = np.maximum.accumulate(nk + span * owner) - span * owner
    # past a request's last node: its last values
    last = np.minimum(np.arange(width + 1)[None, :], np.minimum(sizes, width)[:, None])
    return np.take_along_axis(gains, last, 1), np.take_along_axis(deep, last, 1)


class TreeBudget:
    def __init__(self, max_nodes: int, max_depth: int, explore_every: int = 16,
                 explore_max: int = 256, explore_nodes: tuple[int, ...] = (2, 4),
                 log_every: float = 30.0):
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self.explore_min, self.explore_max = explore_every, explore_max
        self.explore_every = explore_every
        self.explore_nodes = tuple(min(n, max_nodes) for n in explore_nodes)
        self.explore_depth = min(max_depth, 2 * max(self.explore_nodes))
        self._largest = 0   # the largest tree verified so far, in nodes (`node_cap`)
        self.never = os.environ.get("VLLM_DARTREE_PLAIN", "0") not in ("", "0")
        self.use_confidence = os.environ.get("VLLM_DARTREE_CONFIDENCE", "0") not in ("", "0")
        self.compete = os.environ.get("VLLM_DARTREE_COMPETE", "1") not in ("", "0")
        self._explored = False     # the last tree step was an exploration
        # one calibrator per temperature class and node source (drafter / lookup / both)
        self.calibrators = {(g, src): AcceptanceCalibrator() for g in (True, False)
                            for src in (DRAFTER, LOOKUP, BOTH)}
        self.costs = StepCosts()
        # per temperature class and batch class: decayed (observed, predicted) accepted
        # tokens of the trees verified, predicted by the calibrators alone: their bias on the
        # trees the plan *chose*, which the bins (fitted on every verified node) do not see
        self._bias = {(g, c): [0.0, 0.0] for g in (True, False)
                      for c in range(NUM_BATCH_CLASSES)}
        self._class = 0     # the batch class of the last plan (whose trees are walked next)
        # per temperature class and confidence bin: decayed (observed, predicted) accepted
        # tokens of the verified trees (`confidence_factor`); rid -> (bin, factor) of its
        # last plan, which its next walk is booked to
        self._conf = {(g, b): [0.0, 0.0] for g in (True, False) for b in range(NUM_CONF_BINS)}
        self._conf_of: dict[Hashable, tuple[int, float]] = {}
        # rid -> its last tree (scores, depths, sources); a new request's: `_pool_profile`
        self._profiles: dict[Hashable, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # per temperature class: the drafter nodes (scores, depths, sources) of the last
        # POOL_TREES fresh trees (`_blend`); rid -> plans made since its last fresh tree
        self._recent: dict[bool, collections.deque] = {}
        # `_pool_curve` per temperature class, kept while neither the calibration, the
        # selection bias nor the recent trees change (`_version`: bumped by every walk and
        # fresh tree) and the batch class is the same: a run of plain steps plans from it
        self._version = 0
        self._pool_curves: dict[bool, tuple[tuple[int, int], np.ndarray | None]] = {}
        # rid -> (key, gains, depths, unknown, size) of its last curve without lookup nodes
        self._kept_curves: dict[Hashable, tuple] = {}
        self._age: dict[Hashable, int] = {}
        self._costs: BatchCosts | None = None   # the last plan's, for the cut of its trees
        self._plain_run = 0
        self._explore_turn = 0
        self._plain_plans = 0   # plans in a row that came out plain (`skip`)
        self._since_plan = 0    # steps skipped since the last plan
        self.stats = {"steps": 0, "plain_steps": 0, "tree_steps": 0, "explore_steps": 0,
                      "draft_passes": 0,
                      "rounds": 0, "nodes": 0, "predicted_accepted": 0.0,
                      "observed_accepted": 0.0, "lookup_nodes": 0, "lookup_accepted": 0,
                      "shared_nodes": 0, "shared_accepted": 0,
                      "lookup_offered": 0, "lookup_offered_planned": 0, "skipped_plans": 0}
        self._log_every, self._last_log = log_every, time.monotonic()
        self.trace = BudgetTrace.from_env()
        self._plain_rate = 0.0     # the last plan's tokens/s for a plain step (for the trace)

    # -- planning -------------------------------------------------------------------------
    def batch_costs(self, other_rows: int = 0) -> BatchCosts:
        a, b, f, g = self.costs.target_theta
        c, d, e = self.costs.draft_theta
        h, knee = self.costs.hinge
        return BatchCosts(step=a + b * other_rows, row=b, tree_step=f, per_request=d,
                          per_depth=e, draft=c, node=g, excess=h, knee=knee,
                          other_rows=other_rows)

    def shrink(self, greedy: bool, batch: int | None = None) -> float:
        """Observed / predicted accepted tokens of the recently verified trees of a
        temperature class and batch class (default: the last plan's), at most 1 (at least
        1/4): the plan verifies the trees whose predictions are highest, so whatever noise
        the calibrated estimates carry is selected upward, the more so the more trees it
        chooses among (nine requests on the demo prompts: 1.22 predicted and 1.06 accepted
        per tree where one request had 1.61 and 1.66, one shared factor then). A batch
        class starts from the pool of all classes (`BIAS_PRIOR` tokens of it). Every
        prediction the plan and the cut use is scaled by it; it never inflates one (the
        bins catch up with a drafter that does better than predicted, and exploration keeps
        measuring)."""
        batch = self._class if batch is None else batch
        pool_obs = sum(self._bias[greedy, c][0] for c in range(NUM_BATCH_CLASSES))
        pool_pred = sum(self._bias[greedy, c][1] for c in range(NUM_BATCH_CLASSES))
        pool = (pool_obs + 1.0) / (pool_pred + 1.0)
        observed, predicted = self._bias[greedy, batch]
        return min(max((observed + BIAS_PRIOR * pool) / (predicted + BIAS_PRIOR), 0.25), 1.0)

    def confidence_factor(self, greedy: bool, confidence: float | None) -> float:
        """The bin's observed / predicted accepted tokens over the temperature class's
        overall ratio (a bin without a record: 1), clamped to [1/4, 2]; 1 without a
        confidence. Unlike `shrink` it may raise a prediction (capped at p = 1): it tells
        steps apart rather than correcting a bias of the whole plan."""
        if confidence is None:
            return 1.0
        cells = [self._conf[greedy, b] for b in range(NUM_CONF_BINS)]
        overall = (sum(c[0] for c in cells) + 1.0) / (sum(c[1] for c in cells) + 1.0)
        observed, predicted = self._conf[greedy, confidence_bin(confidence)]
        ratio = (observed + CONF_PRIOR * overall) / (predicted + CONF_PRIOR)
        return float(np.clip(ratio / overall, *CONF_RANGE))

    def predict(self, rid, greedy: bool, scores: np.ndarray, depths: np.ndarray,
                sources: np.ndarray | None = None, factor: float = 1.0) -> np.ndarray:
        """Calibrated acceptance of nodes [M] (each by its source's calibrator), scaled by a
        confidence factor (capped at 1) and shrunk by the class's selection bias
        (`shrink`)."""
        if sources is None:
            p = self.calibrators[greedy, DRAFTER].predict(scores, depths, rid)
        else:
            p = np.zeros(len(scores))
            for src in np.unique(sources).tolist():
                at = sources == src
                p[at] = self.calibrators[greedy, src].predict(scores[at], depths[at], rid)
        if factor != 1.0:
            p = np.minimum(p * factor, 1.0)
        return p * self.shrink(greedy)

    def _gains(self, rid, greedy: bool, scores, depths, sources=None, factor: float = 1.0):
        p = self.predict(rid, greedy, scores, depths, sources, factor)
        need = depths if sources is None else np.where(sources == LOOKUP, 0, depths)
        return _curve(p, need, self.max_nodes)

    def plan(self, rids: Sequence[Hashable], greedy: Sequence[bool], num_running: int,
             lookup: Sequence[tuple[np.ndarray, np.ndarray] | None] | None = None,
             confidence: Sequence[float | None] | None = None) -> BudgetPlan:
        """Nodes per request for the next step; `num_running` requests decode in it.
        `lookup[i]`: (prior scores, depths) of request i's lookup nodes this round, known
        before drafting; they replace the lookup nodes of its last tree in the prediction
        and need no drafter depth (depth 0 with nodes: a lookup-only step, no drafter pass).
        `confidence[i]`: the target's probability of its likeliest token at request i's last
        sampled row (`confidence_factor`; None: unknown)."""
        self._class = batch_class(num_running)
        factors = None
        if confidence is not None and self.use_confidence:   # off by default: no loop
            factors, memo = np.ones(len(rids)), {}
            for i, (rid, g, c) in enumerate(zip(rids, greedy, confidence)):
                if c is None:
                    self._conf_of.pop(rid, None)
                    continue
                cell = (bool(g), confidence_bin(c))
                if cell not in memo:
                    memo[cell] = self.confidence_factor(g, c)
                factors[i] = memo[cell]
                self._conf_of[rid] = (cell[1], memo[cell])
        plan, unknown, whole = self._plan(rids, greedy, num_running, lookup, factors)  # ~1 ms
        if lookup is not None:   # how often lookup had something, and how often it was used
            offered = np.array([f is not None for f in lookup], dtype=bool)
            self.stats["lookup_offered"] += int(offered.sum())
            self.stats["lookup_offered_planned"] += int((offered & (plan.nodes > 0)).sum())
        out = self._finish(plan, unknown, factors, whole)
        if self.trace is not None:
            self.trace.event("plan", id=self.stats["steps"], running=num_running,
                             requests=len(rids),
                             nodes=int(out.nodes.sum()), depth=int(out.depth),
                             rate=float(plan.rate), plain_rate=float(self._plain_rate),
                             explore=bool(out.explore.any()))
        return out

    def _profile_nodes(self, rid, g: bool, found):
        """(scores, depths, sources) of request rid's predicted tree, unordered; None when
        there is nothing to predict from."""
        profile = self._profiles.get(rid) or self._pool_profile(g)
        if profile is None and found is None:
            return None
        scores, depths, sources = profile if profile is not None else (
            np.zeros(0), np.zeros(0, dtype=np.int64), None)
        if sources is None:
            sources = np.full(len(scores), DRAFTER)
        keep = sources != LOOKUP
        scores, depths, sources = scores[keep], depths[keep], sources[keep]
        if found is not None:
            scores = np.concatenate([scores, found[0]])
            depths = np.concatenate([depths, found[1]])
            sources = np.concatenate([sources, np.full(len(found[0]), LOOKUP)])
        return scores, depths, sources

    def _pool_profile(self, greedy: bool):
        """A new request's predicted tree: the largest of its temperature class's recent
        fresh trees (the latest of equals), its estimates then blended rank by rank with the
        pool's (`_blend`). The last tree alone was whatever size its request's last plan
        drafted: at the start of a request trees grow over a few steps (`_growth`), so a
        new request that started from another's growing tree grew again (with the oracle
        drafter, 12 nodes planned from a 20-node tree drafted 9 deep while the trees before
        it had reached 32; 48 tokens are 3 of its steps)."""
        trees = self._recent.get(greedy)
        return max(reversed(trees), key=lambda tree: len(tree[0])) if trees else None

    @property
    def node_cap(self) -> int:
        """The most nodes a request may verify next: twice the largest tree verified so far
        (at least the exploration's size), up to `max_nodes`. A fresh engine's estimates
        are priors (the drafter's own probabilities, a row at 1/20 of a step); planned from
        them alone, its first steps verified 64 nodes for each of four requests, 256 rows a
        step on a CPU, before the measured costs took over. So trees grow by doubling, each
        size planned only once a tree half as large has been timed and walked."""
        return min(self.max_nodes, max(max(self.explore_nodes), 2 * self._largest))

    def _plan(self, rids, greedy, num_running, lookup=None,
              factors: np.ndarray | None = None) -> tuple[Plan, np.ndarray, bool]:
        """The plan, which requests had nothing to predict from, and whether it takes the
        whole predicted tree of some request (`_growth`)."""
        gains, depths, unknown, sizes = self._curves(rids, greedy, lookup, factors)
        # requests that decode without a drafting candidate still cost their row
        costs = self.batch_costs(max(num_running - len(rids), 0))
        self._costs = costs
        cap = self.node_cap
        if cap < self.max_nodes:
            gains, depths = gains[:, :cap + 1], depths[:, :cap + 1]
        plan = plan_budgets(gains, depths, costs)
        if self.trace is not None:   # the same cost model's plain step, for the trace alone
            self._plain_rate = throughput(gains, depths, np.zeros(len(rids), dtype=np.int64),
                                          costs)
        whole = bool(((plan.nodes > 0) & (plan.nodes >= np.minimum(sizes, self.max_nodes))).any())
        return plan, unknown, whole

    def _curves(self, rids, greedy, lookup=None, factors: np.ndarray | None = None):
        """Every request's prefix curves (gains, depths: [R, B + 1]) of its predicted tree,
        best-first by calibrated p (times each request's confidence factor, `factors` [R]),
        which requests had nothing to predict from [R], and the predicted trees' sizes [R].

        A request without lookup nodes this round (and without a confidence factor) keeps
        its curve while nothing it depends on changes (`_version`, the batch class, its
        profile's age up to `AGE_CAP`): a run of plain steps at 16 requests plans mostly from
        kept curves."""
        r = len(rids)
        gains = np.zeros((r, self.max_nodes + 1))
        depths = np.zeros((r, self.max_nodes + 1), dtype=np.int64)
        unknown = np.zeros(r, dtype=bool)
        sizes = np.zeros(r, dtype=np.int64)
        ages = [self._age.get(rid, 0) for rid in rids]
        todo, keys = [], {}
        for i, (rid, g) in enumerate(zip(rids, greedy)):
            if factors is None and (lookup is None or lookup[i] is None):
                key = (self._version, self._class, bool(g), min(ages[i], AGE_CAP))
                kept = self._kept_curves.get(rid)
                if kept is not None and kept[0] == key:
                    _, gains[i], depths[i], unknown[i], sizes[i] = kept
                    continue
                keys[i] = key
            todo.append(i)
        if todo:
            sub = self._curves_now([rids[i] for i in todo], [greedy[i] for i in todo],
                                   None if lookup is None else [lookup[i] for i in todo],
                                   None if factors is None else np.asarray(factors)[todo],
                                   np.asarray([ages[i] for i in todo], dtype=np.float64))
            for j, i in enumerate(todo):
                gains[i], depths[i], unknown[i], sizes[i] = (part[j] for part in sub)
                if i in keys:
                    self._kept_curves[rids[i]] = (keys[i], gains[i].copy(), depths[i].copy(),
                                                  bool(unknown[i]), int(sizes[i]))
        for rid, age in zip(rids, ages):   # one plan older
            self._age[rid] = age + 1
        return gains, depths, unknown, sizes

    def _curves_now(self, rids, greedy, lookup, factors, ages):
        """`_curves` computed for these requests (their profiles' `ages` [R])."""
        r = len(rids)
        gains = np.zeros((r, self.max_nodes + 1))
        depths = np.zeros((r, self.max_nodes + 1), dtype=np.int64)
        unknown = np.zeros(r, dtype=bool)
        # every request's predicted tree at once: one calibrator lookup per (class, source)
        # for the whole batch, one sort (a per-request loop cost ~3 ms a step at 16)
        parts = [self._profile_nodes(rid, g, None if lookup is None else lookup[i])
                 for i, (rid, g) in enumerate(zip(rids, greedy))]
        for i, part in enumerate(parts):
            unknown[i] = part is None
        sizes = np.array([0 if part is None else len(part[0]) for part in parts],
                         dtype=np.int64)
        if sizes.sum():
            known = [part for part in parts if part is not None]
            owner = np.repeat(np.arange(r), sizes)
            scores = np.concatenate([part[0] for part in known]).astype(np.float64)
            node_depths = np.concatenate([part[1] for part in known]).astype(np.int64)
            sources = np.concatenate([part[2] for part in known])
            node_greedy = np.asarray(greedy, dtype=bool)[owner]
            p = np.zeros(len(scores))
            scale = np.ones(r) if factors is None else np.asarray(factors, dtype=np.float64)
            for (g, src), cal in self.calibrators.items():
                at = (node_greedy == g) & (sources == src)
                if at.any():
                    correction = np.array([cal.correction(rid) for rid in rids]) * scale
                    p[at] = np.minimum(cal.predict(scores[at], node_depths[at])
                                       * correction[owner[at]], 1.0) * self.shrink(g)
            p = self._blend(p, owner, sources, ages, greedy, sizes)
            if self.compete and lookup is not None:
                p = _compete(p, owner, sources, node_depths, r)
            order = np.lexsort((node_depths, -p, owner))
            p, node_depths, sources = p[order], node_depths[order], sources[order]
            need = np.where(sources == LOOKUP, 0, node_depths)
            gains, depths = _curves_sorted(p, need, sizes, self.max_nodes)
        return gains, depths, unknown, sizes

    def _blend(self, p: np.ndarray, owner: np.ndarray, sources: np.ndarray,
               ages: np.ndarray, greedy, sizes: np.ndarray) -> np.ndarray:
        """Each request's drafter-node estimates p (nodes grouped by `owner`), blended rank by
        rank with its temperature class's pool average (`PROFILE_WEIGHT`, halved for each
        of the `ages` [R] plans its profile has been used in)."""
        pools = {cls: self._pool_curve(cls) for cls in set(map(bool, greedy))}
        if not any(curve is not None for curve in pools.values()):
            return p
        drafter = sources != LOOKUP
        order = np.lexsort((-p, ~drafter, owner))   # per request: its drafter nodes first,
        starts = np.cumsum(sizes) - sizes
        rank = np.arange(len(p)) - starts[owner[order]]
        take = drafter[order]
        out = p.copy()                              # best first (rank = place among them)
        g = np.asarray(greedy, dtype=bool)
        for cls, pool in pools.items():
            at = take & (g[owner[order]] == cls)
            if pool is None or not at.any():
                continue
            nodes, ranks = order[at], rank[at]
            weight = PROFILE_WEIGHT * 0.5 ** ages[owner[nodes]]
            prior = np.where(ranks < len(pool), pool[np.minimum(ranks, len(pool) - 1)], np.nan)
            mixed = weight * p[nodes] + (1 - weight) * prior
            out[nodes] = np.where(np.isnan(prior), p[nodes], mixed)
        return out

    def _pool_curve(self, greedy: bool) -> np.ndarray | None:
        """The average estimate at each best-first rank of the drafter nodes of the class's
        last fresh trees [max_nodes], by the current calibration, over the trees that reach
        that rank (NaN where none does; `_blend` then keeps the request's own estimate);
        None before any tree. A tree's size says how deep it was drafted, a decision, not
        that its deeper nodes would have been wrong: averaged in as zeros, the ramp of
        small trees at each request's start (the growth of `_growth`) made every new
        request start small again (with the oracle drafter, 12 nodes planned for a new
        request where the pool's last tree had 28, all of them earning)."""
        key = (self._version, self._class)
        cached = self._pool_curves.get(greedy)
        if cached is None or cached[0] != key:
            cached = self._pool_curves[greedy] = (key, self._pool_curve_now(greedy))
        return cached[1]

    def _pool_curve_now(self, greedy: bool) -> np.ndarray | None:
        trees = self._recent.get(greedy)
        if not trees:
            return None
        sizes = np.array([len(t[0]) for t in trees])
        tree = np.repeat(np.arange(len(trees)), sizes)
        p = self.predict(None, greedy, np.concatenate([t[0] for t in trees]),
                         np.concatenate([t[1] for t in trees]),
                         np.concatenate([t[2] for t in trees]))
        order = np.lexsort((-p, tree))
        rank = np.arange(len(p)) - (np.cumsum(sizes) - sizes)[tree[order]]
        keep = rank < self.max_nodes
        total = np.bincount(rank[keep], weights=p[order][keep], minlength=self.max_nodes)
        count = np.bincount(rank[keep], minlength=self.max_nodes)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, total / count, np.nan)[:self.max_nodes]

    def _remember(self, rid, greedy: bool, scores: np.ndarray, depths: np.ndarray,
                  sources: np.ndarray | None) -> None:
        """A fresh tree of the drafter's: its drafter nodes join the pool's recent trees
        (`_blend`), and the request's profile is new again."""
        self._age[rid] = 0
        self._version += 1
        sources = np.full(len(scores), DRAFTER) if sources is None else np.asarray(sources)
        own = sources != LOOKUP
        if own.any():
            self._recent.setdefault(greedy, collections.deque(maxlen=POOL_TREES)).append(
                (np.asarray(scores, dtype=np.float64)[own], np.asarray(depths)[own],
                 sources[own]))

    def _finish(self, plan: Plan, unknown: np.ndarray,
                factors: np.ndarray | None = None, whole: bool = False) -> BudgetPlan:
        """Exploration on top of the plan, and the counters."""
        r = len(unknown)
        nodes, depth = plan.nodes.copy(), plan.depth
        explore = unknown.copy()
        self.stats["steps"] += 1
        if self.never:
            nodes[:], explore[:] = 0, False
        elif nodes.any():
            self.explore_every = self.explore_min      # the plan drafts by itself
            self._explored = False
        elif not explore.any():
            if self._explored:                         # explored, still not worth it
                self.explore_every = min(2 * self.explore_every, self.explore_max)
                self._explored = False
            self._plain_run += 1
            if self._plain_run >= self.explore_every and r:
                explore[self._explore_turn % r] = True
        if explore.any():
            size = self.explore_nodes[self._explore_turn % len(self.explore_nodes)]
            self._explore_turn += 1
            nodes[explore] = size
            depth = max(depth, self.explore_depth)
            self._explored = True
            self.stats["explore_steps"] += 1
        if nodes.any():
            self._plain_run = self._plain_plans = 0
            self.stats["tree_steps"] += 1
            if depth > 0:   # deeper than planned, so the profile can grow (0: lookup only)
                depth = min(self.max_depth, depth + _growth(depth, whole))
        else:
            self.stats["plain_steps"] += 1
            self._plain_plans += 1
        return BudgetPlan(nodes, depth, plan.rate, explore, factors)

    def skip(self, num_running: int) -> bool:
        """Whether this step goes without a plan (a plain step): after `SKIP_AFTER[0]` plain
        plans in a row only every 2nd step plans, after `SKIP_AFTER[1]` every 4th, until a
        plan verifies a tree (or explores). A skipped step is booked as a plain one. What it
        gives up: a lookup match or a better estimate is seen up to 3 steps late."""
        run = self._plain_plans
        every = 4 if run >= SKIP_AFTER[1] else 2 if run >= SKIP_AFTER[0] else 1
        if self._since_plan + 1 >= every:
            self._since_plan = 0
            return False
        self._since_plan += 1
        self.stats["steps"] += 1
        self.stats["plain_steps"] += 1
        self.stats["skipped_plans"] += 1
        if self.trace is not None:
            self.trace.event("plan", id=self.stats["steps"], running=num_running, requests=0,
                             nodes=0, depth=0, rate=float(self._plain_rate),
                             plain_rate=float(self._plain_rate), explore=False, skipped=True)
        return True

    def cut(self, rid, greedy: bool, scores: np.ndarray, depths: np.ndarray,
            plan: BudgetPlan, i: int, sources: np.ndarray | None = None) -> int:
        """Nodes of request i's fresh tree (best-first, scores / depths / sources [m]) to
        verify."""
        # a lookup-only tree (no drafter pass) says nothing new about the drafter's nodes:
        # the last profile keeps them (its lookup nodes are replaced each round anyway), and
        # a request without one keeps predicting from the pool's. (Stored as the profile of a
        # new request, a lookup-only first tree left it no drafter nodes to predict from:
        # every later round without a lookup match was planned plain until an exploration
        # came round, 27% of the steps at one request on the demo prompts.)
        if sources is None or bool((sources != LOOKUP).any()):
            self._profiles[rid] = (scores, depths, sources)
            self._remember(rid, greedy, scores, depths, sources)
        if plan.explore[i]:
            return min(len(scores), int(plan.nodes[i]))
        factor = 1.0 if plan.factor is None else float(plan.factor[i])
        gains, _ = self._gains(rid, greedy, scores, depths, sources, factor)
        costs = self._costs or self.batch_costs()
        return int(cut(gains[None], costs.node_row, plan.rate,
                       np.array([min(len(scores), self.node_cap)]),
                       costs.excess, costs.allowance(len(plan.nodes)))[0])

    # -- observations ---------------------------------------------------------------------
    def observe_walk(self, rid, greedy: bool, scores: np.ndarray, depths: np.ndarray,
                     accepted: Sequence[int], sources: np.ndarray | None = None) -> None:
        """A verified tree (its scheduled prefix) and the node indices the walk accepted."""
        self.observe_walks([(rid, greedy, scores, depths, accepted, sources)])

    def observe_walks(self, walks) -> None:
        """A step's verified trees [(rid, greedy, scores, depths, accepted, sources)], in
        order: each calibrator takes its nodes of all of them in one update (one table
        rebuild per step instead of one per tree: 2.2 -> 0.5 ms for three trees here)."""
        parts: dict[tuple[bool, int], list] = {}    # calibrator -> [(tree j, its nodes)]
        trees = []
        for j, (rid, greedy, scores, depths, accepted, sources) in enumerate(walks):
            labels = np.zeros(len(scores), dtype=bool)
            labels[list(accepted)] = True
            if sources is None:
                sources = np.full(len(scores), DRAFTER)
            trees.append((rid, greedy, scores, labels, sources))
            for src in np.unique(sources).tolist():
                at = sources == src
                parts.setdefault((greedy, src), []).append(
                    (j, (scores[at], depths[at], labels[at], rid)))
        predicted = np.zeros(len(trees))
        observed = np.zeros(len(trees))
        for key, items in parts.items():
            results = self.calibrators[key].update_many([nodes for _, nodes in items])
            for (j, _), (pr, ob) in zip(items, results):
                predicted[j] += pr
                observed[j] += ob
        self._largest = max([self._largest] + [len(t[2]) for t in trees])
        for j, (rid, greedy, scores, labels, sources) in enumerate(trees):
            self._book_walk(rid, greedy, len(scores), labels, sources, float(predicted[j]),
                            float(observed[j]))
        self._version += 1

    def _book_walk(self, rid, greedy: bool, nodes: int, labels: np.ndarray,
                   sources: np.ndarray, predicted: float, observed: float) -> None:
        """A walked tree's selection bias, confidence bin, counters and trace event."""
        shrink = self.shrink(greedy)        # what the plan used for this tree
        raw = predicted
        bias = self._bias[greedy, self._class]
        bias[0] = BIAS_DECAY * bias[0] + observed
        bias[1] = BIAS_DECAY * bias[1] + predicted
        booked = self._conf_of.pop(rid, None)
        if booked is not None:              # the confidence bin its plan saw
            cell = self._conf[greedy, booked[0]]
            cell[0] = CONF_DECAY * cell[0] + observed
            cell[1] = CONF_DECAY * cell[1] + predicted
            predicted = min(predicted * booked[1], float(nodes))
        predicted *= shrink
        s = self.stats
        for name, src in (("lookup", LOOKUP), ("shared", BOTH)):
            at = sources == src
            s[f"{name}_nodes"] += int(np.count_nonzero(at))
            s[f"{name}_accepted"] += int(np.count_nonzero(labels & at))
        s["rounds"] += 1
        s["nodes"] += nodes
        if self.trace is not None:
            self.trace.event("walk", nodes=nodes, predicted=float(predicted),
                             observed=float(observed), raw=float(raw),
                             conf=None if booked is None else int(booked[0]))
        s["predicted_accepted"] += predicted
        s["observed_accepted"] += observed

    def observe_step(self, rows: int, tree: bool, seconds: float, plan: int | None = None,
                     nodes: int = 0) -> None:
        """A decode step's seconds (drafting excluded); `plan`: the number of plans made
        before it started (the last one's trees are those it verified), for the trace; `nodes`:
        the tree nodes among its rows."""
        self.costs.observe_target(rows, int(tree), seconds, nodes)
        if self.trace is not None:
            self.trace.event("step", plan=plan, rows=int(rows), nodes=int(nodes),
                             tree=bool(tree), s=float(seconds))
        self._maybe_log()

    def observe_draft(self, requests: int, depths: int, seconds: float,
                      extended: int = 0) -> None:
        """A drafter round of `requests` x `depths`, `seconds` with the extension of the
        `extended` context rows that waited for it (`StepCosts.observe_draft`)."""
        self.costs.observe_draft(requests, depths, seconds, extended)
        if self.trace is not None:
            self.trace.event("draft", requests=int(requests), depths=int(depths),
                             s=float(seconds), extended=int(extended))
        self.stats["draft_passes"] += 1

    def free(self, rid: Hashable) -> None:
        self._profiles.pop(rid, None)
        self._age.pop(rid, None)
        self._kept_curves.pop(rid, None)
        self._conf_of.pop(rid, None)
        for cal in self.calibrators.values():
            cal.free(rid)

    @property
    def live_requests(self) -> int:
        """Requests with per-request state here (0 once every request has finished)."""
        rids = set(self._profiles) | set(self._conf_of) | set(self._age) | set(self._kept_curves)
        for cal in self.calibrators.values():
            rids |= cal.request_ids
        return len(rids)

    def summary(self) -> dict:
        a, b, f, g = self.costs.target_theta
        c, d, e = self.costs.draft_theta
        out = {**self.stats, "live_requests": self.live_requests,
               "shrink_greedy": self.shrink(True), "shrink_sampled": self.shrink(False),
               "cost_step_s": a, "cost_row_s": b, "cost_tree_step_s": f, "cost_node_s": g,
               "cost_draft_s": c, "cost_draft_request_s": d, "cost_draft_depth_s": e,
               "cost_excess_row_s": self.costs.hinge[0],
               "cost_new_rows_s": self.costs.setup[0], "cost_new_draft_s": self.costs.setup[1],
               "cost_knee_rows": -1 if self.costs.knee is None else self.costs.knee}
        # plain Python numbers: the RPC's serialiser takes no numpy scalars
        return {k: v if isinstance(v, int) else float(v) for k, v in out.items()}

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self._log_every:
            return
        self._last_log = now
        s = self.stats
        rounds = max(s["rounds"], 1)
        logger.info("DARTree budget: %d steps, %.0f%% plain; %d trees of %.1f nodes, accepted "
                    "per tree %.2f predicted / %.2f observed; row %.1f ms, step %.1f ms",
                    s["steps"], 100 * s["plain_steps"] / max(s["steps"], 1), s["rounds"],
                    s["nodes"] / rounds, s["predicted_accepted"] / rounds,
                    s["observed_accepted"] / rounds, 1e3 * self.costs.target_theta[1],
                    1e3 * self.costs.target_theta[0])
