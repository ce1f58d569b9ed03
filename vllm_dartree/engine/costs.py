"""Measured costs: how long a step takes as a function of what it verifies and drafts.

The runner times every decode step of its own engine (no table typed in per machine):

- target: the model forward, the walk and the rest of the step (`execute_model` +
  `sample_tokens` minus drafting), against x = [1, decode rows, tree, nodes] (decode rows:
  one per request; tree = 1 when the step verified trees: the masks, the walk and the
  compaction cost something whatever the trees' size; nodes = the tree nodes verified), each
  slope fitted on its own. A tree node may cost more than a decode row (its attention runs
  the tree kernel, the walk and the compaction handle it: on a 2-core CPU at 16 requests a
  decode row cost 1.2 ms and a tree node 0.4 ms more; with one slope for both, a 26-node
  step was predicted at 83 ms and took 96) or less (it shares its request's context and
  weights' pass: at 4 requests on a Xeon a decode row cost 2.7 ms and a lookup node 1.2 ms,
  where a fit that could only add to the row's slope charged 2.5 ms a node and turned down
  lookup trees that paid);
- draft: the drafter's round, against x = [1, drafted requests, drafted requests x depths
  computed] (the lm-head and the correction head run per request and depth), timed with the
  extension of the context rows that waited for it (`engine.lazy_context`: 1.1-1.2 ms of a
  one-request round's 5 ms on a 2-core CPU, 1.4 ms a step at 16 requests), which no fit
  counted before: a request that drafts pays it, one that stays plain does not.

A step of a shape not seen before (target: its rows; draft: its requests and depths) pays
the matrix library's one-time setup for that shape. vLLM's CPU linear layers (oneDNN) set up
each new number of rows on first use (1,536 x 576, fp32, one core: 0.7-1.3 ms on the first
call of a row count against 0.2-0.3 ms after; the 120 linear layers of SmolLM2 together
about 8 ms in fp32 and 2-4 ms in bf16 on an AMX Xeon). Trees of new sizes are mostly where
new row counts come from. Counted as ordinary steps, the setup made the tree-step
coefficient read +3.4 ms at one request (run AP, docs/engine.md) and the budget kept 75% of
the steps plain. Left out of the fits (as they once were), the steps that showed what large
trees cost were never seen: at 16 requests in bf16 nearly every tree step had a row count of
its own (16 requests with 5-10 nodes each: 94, 101, 134, 156, ... rows), so the fit kept
the slope it had learnt at one or two requests and planned 16-request trees at 1.4x plain
decoding's rate that realized 0.96x (DARTree 0.78x plain at 16 requests). A feature of its
own for a shape's first step was tried next: at one request, where new row counts come
almost only from tree steps, it traded places with the tree-step cost from one engine to
the next (+9.8 ms a tree step and no setup in one, +0.1 and +12 ms in the other, the same
run), and the plan's share of plain steps with it (66% against 20%). So the setup is
measured apart, from pairs (`SetupEstimate`): a shape's first step's seconds less its
second step's (less the fit's price of any difference in their work). A shape's first step
joins the fits less that setup, once `SETUP_PAIRS` pairs have told it, and as it came before
that (the few steps until then overstate their shapes' cost by the setup, and the fit's
decay forgets them). The plan prices a step as a seen shape (a setup is paid once per shape
and engine).

Each is a decayed least-squares fit (the machine is shared and its speed drifts) started from
a weak prior: a verified row costs 1/20 of a one-request step, a draft as much as 1/2 of it.
The prior (worth 1/20 of an observation) only decides what the data cannot (a row cost
while every step is plain); a few measured steps outweigh it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DecayedLeastSquares", "SetupEstimate", "StepCosts"]


class DecayedLeastSquares:
    """y ~ x . theta with exponentially decayed sufficient statistics and a ridge prior."""

    def __init__(self, prior: np.ndarray, prior_weight: float = 0.05, decay: float = 0.98,
                 warmup: int = 3, clip: float = 4.0):
        self.prior = np.asarray(prior, dtype=np.float64)
        k = len(self.prior)
        self.decay, self.prior_weight = decay, prior_weight
        self.xx = np.zeros((k, k))
        self.xy = np.zeros(k)
        self.weight = 0.0     # decayed number of observations
        self.count = 0
        # the first calls of a fresh process pay one-time costs (allocations, lazy
        # initialisation); later outliers (a preempted process) are clipped to `clip` times
        # the current fit, so one bad second cannot make drafting look dear for minutes
        self.warmup, self.clip = warmup, clip
        self._seen = 0
        self._theta: np.ndarray | None = None   # the last solve ...
        self._since = 0                          # ... and the additions made since

    def add(self, x, y: float, theta: np.ndarray | None = None) -> None:
        """One observation; `theta`: the fit its outlier clip uses (default: the current)."""
        x = np.asarray(x, dtype=np.float64)
        self._seen += 1
        if self._seen <= self.warmup:
            return
        if self.count >= 10:
            fit = float(x @ (self.theta() if theta is None else theta))
            if fit > 0:
                y = min(max(float(y), fit / self.clip), fit * self.clip)
        self.xx = self.decay * self.xx + np.outer(x, x)
        self.xy = self.decay * self.xy + x * float(y)
        self.weight = self.decay * self.weight + 1.0
        self.count += 1
        self._since += 1

    def theta(self, stale: int = 0) -> np.ndarray:
        """The fitted coefficients, solved once per change of the statistics (the plan of a
        step and the clip of its observation share one solve); `stale`: a solve up to that
        many additions old will do."""
        if self._theta is None or self._since > stale:
            self._theta, self._since = self._solve(), 0
        return self._theta

    def _solve(self) -> np.ndarray:
        # the prior counts as `prior_weight` observations of typical size per feature
        typical = np.diag(self.xx) / self.weight if self.weight > 0 else np.ones(len(self.prior))
        ridge = self.prior_weight * np.diag(np.maximum(typical, 1e-12))
        a, y = self.xx + ridge, self.xy + ridge @ self.prior
        # costs never fall with more work: a coefficient the fit wants negative is fixed at
        # 0 and the others are refitted without it (clipping it alone would break the sums
        # the data does fix: with one request per step, the step and row costs are
        # collinear, and only their sum is measured)
        free = np.ones(len(y), dtype=bool)
        theta = np.zeros(len(y))
        while free.any():
            theta[:] = 0.0
            theta[free] = np.linalg.solve(a[np.ix_(free, free)], y[free])
            if (theta >= 0).all():
                break
            free &= theta > 0
        return theta


SETUP_DECAY = 0.9   # per pair: the setup follows the last ~10 shapes seen twice
SETUP_PAIRS = 3     # pairs before a shape's first step joins the fits (less the setup)


class SetupEstimate:
    """The one-time setup of a new shape, from pairs: a shape's first step's seconds less
    its second's, less what the fit says their difference in work costs (nothing when they
    did the same work: at one request a row count is one tree size). Unlike a residual
    under the fit, this needs no fit yet, and the fit's own error for the shape cancels."""

    def __init__(self):
        self._first: dict = {}     # shape -> (features, seconds) of its first step
        self._sum = self._weight = 0.0
        self.pairs = 0

    def first(self, shape, x, seconds: float) -> None:
        self._first[shape] = (np.asarray(x, dtype=np.float64), seconds)

    def again(self, shape, x, seconds: float, fit: DecayedLeastSquares) -> None:
        """A later step of `shape`: the second pairs with the first (`fit` prices any
        difference in their work, once it has 10 observations)."""
        first = self._first.pop(shape, None)
        if first is None:
            return
        dx = first[0] - np.asarray(x, dtype=np.float64)
        price = 0.0
        if dx.any():
            if fit.count < 10:
                return             # different work and no fit to price it with yet
            price = float(dx @ fit.theta()[:len(dx)])
        diff = first[1] - seconds - price
        self._sum = SETUP_DECAY * self._sum + diff
        self._weight = SETUP_DECAY * self._weight + 1.0
        self.pairs += 1

    @property
    def seconds(self) -> float | None:
        """The setup (at least 0); None before `SETUP_PAIRS` pairs."""
        if self.pairs < SETUP_PAIRS:
            return None
        return max(0.0, self._sum / self._weight)


# Where a step's rows start to cost (`StepCosts`): candidate knees K, in rows. None: no knee.
KNEES = (None, 4, 8, 16, 32, 64)
ERROR_DECAY = 0.98
# context rows a request extends per round in the steady state: one per decode step since
# its last round, plus its accepted nodes (`observe_draft`)
STEADY_ROWS = 16
STALE_SOLVES = 4


class StepCosts:
    """The fits of a worker: a step without drafting, and the drafter's round.

    A step's rows are not priced alike at every batch: at one request a CPU step reads every
    weight once and the first few rows ride along nearly free (memory-bound), while past some
    rows each one costs its products (compute-bound). A linear fit over trees of 3 to 28 nodes
    charged small trees the large ones' slope (one request, an EPYC: a node at 0.8-0.9 ms
    where a 5-row tree step cost what a plain one did). So the target fit has a hinge, h per
    row past K rows (x gains max(0, rows - K)); K is not known per machine, so one fit per
    candidate in `KNEES` (None: no hinge, the linear model) runs side by side, and the one
    whose decayed squared error of prediction (each observation predicted before it is
    added) is smallest is used."""

    def __init__(self, plain_step: float = 0.05):
        # prior: a plain one-request step of `plain_step` s, a row 1/20 of it (a tree node
        # as much as a decode row until measured otherwise), no hinge, a draft 1/2
        base = [plain_step, plain_step / 20, plain_step / 20, 0.0]
        self._fits = {k: DecayedLeastSquares(np.array(base if k is None else base + [0.0]))
                      for k in KNEES}
        self._errors = {k: 0.0 for k in KNEES}
        self.draft_fit = DecayedLeastSquares(np.array([plain_step / 4, plain_step / 8,
                                                       plain_step / 64]))
        self._target_theta: np.ndarray | None = None
        self._draft_theta: np.ndarray | None = None
        self.knee: int | None = None   # the knee in use (None: the linear model)
        # shapes seen: a step of a new one pays one-time setup (`SetupEstimate`)
        self._target_shapes: set[int] = set()
        self._draft_shapes: set[tuple[int, int]] = set()
        self.target_setup, self.draft_setup = SetupEstimate(), SetupEstimate()

    @staticmethod
    def _features(knee: int | None, rows: int, tree: int, nodes: int) -> list[float]:
        x = [1.0, rows - nodes, tree, nodes]
        return x if knee is None else x + [max(0.0, rows - knee)]

    @property
    def target_fit(self) -> DecayedLeastSquares:
        """The fit in use (the knee with the smallest recent error of prediction)."""
        return self._fits[self.knee]

    def observe_target(self, rows: int, tree: int, seconds: float, nodes: int = 0) -> None:
        """A step of `rows` verified tokens, `nodes` of them tree nodes (rows - nodes
        decode rows), `tree` = 1 when it verified trees. The first step of each row count
        is observed less its one-time setup (`SetupEstimate`) once that is known."""
        new = rows not in self._target_shapes
        self._target_shapes.add(rows)
        # a pair's two steps have the same rows, so the hinge's feature is the same in both
        seconds = self._less_setup(self.target_setup, self.target_fit,
                                   self._features(None, rows, tree, nodes), rows, new,
                                   seconds)
        for k, fit in self._fits.items():
            x = self._features(k, rows, tree, nodes)
            theta = None
            if fit.count >= 10:
                # the knees not in use are judged by a solve up to STALE_SOLVES steps old
                # (six 4-5 parameter solves a step cost 0.5 ms in Python)
                theta = fit.theta(0 if k == self.knee else STALE_SOLVES)
                error = float(np.dot(x, theta)) - seconds
                self._errors[k] = ERROR_DECAY * self._errors[k] + error * error
            fit.add(x, seconds, theta)
        if any(self._errors.values()):   # the smallest error; ties to the simpler model
            self.knee = min(KNEES, key=lambda k: (self._errors[k], k is not None, k or 0))
        self._target_theta = None

    def observe_draft(self, requests: int, depths: int, seconds: float,
                      extended: int = 0) -> None:
        """A drafter round, `seconds` including the extension of the `extended` context
        rows that waited for it (the rows each request committed since its last round: a
        round costs that whenever it is run, and the target's step does not time it). A
        round that extends more than `STEADY_ROWS` rows a request (a new request's prompt,
        paid once whenever it first drafts) is not observed; the first of each (requests,
        depths) is observed less its one-time setup once that is known."""
        if extended > STEADY_ROWS * requests:
            return
        shape = (requests, depths)
        new = shape not in self._draft_shapes
        self._draft_shapes.add(shape)
        x = [1.0, requests, requests * depths]
        seconds = self._less_setup(self.draft_setup, self.draft_fit, x, shape, new, seconds)
        self.draft_fit.add(x, seconds)
        self._draft_theta = None

    @staticmethod
    def _less_setup(setup: SetupEstimate, fit: DecayedLeastSquares, x, shape, new: bool,
                    seconds: float) -> float:
        """A step's seconds for the fit: its first of a shape less the setup once that is
        known (before, as it came: the early steps that show what large trees cost must
        reach the fit); the pairs of first and second steps feed the setup's estimate."""
        if new:
            setup.first(shape, x, seconds)
        else:
            setup.again(shape, x, seconds, fit)
        known = setup.seconds if new else None
        return seconds if known is None else seconds - known

    @property
    def target_theta(self) -> np.ndarray:
        """(seconds per step, per verified row, per step that verifies trees, per tree node
        on top of its row: negative where a tree node costs less than a decode row)."""
        if self._target_theta is None:
            theta = self.target_fit.theta()
            a, b, f, node = theta[:4]
            self._target_theta = np.array([a, b, f, node - b])
        return self._target_theta

    @property
    def hinge(self) -> tuple[float, float]:
        """(seconds per row past the knee, the knee in rows): (0, inf) without one."""
        knee = self.knee
        if knee is None:
            return 0.0, float("inf")
        return float(self.target_fit.theta()[4]), float(knee)

    @property
    def setup(self) -> tuple[float, float]:
        """(seconds a target step of a new row count pays once, a draft round of a new
        (requests, depths) once): the estimates of `SetupEstimate` (0 while unknown)."""
        return (self.target_setup.seconds or 0.0, self.draft_setup.seconds or 0.0)

    @property
    def draft_theta(self) -> np.ndarray:
        """(seconds per round, per drafted request, per drafted request and depth)."""
        if self._draft_theta is None:
            self._draft_theta = self.draft_fit.theta()
        return self._draft_theta
