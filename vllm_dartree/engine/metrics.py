"""Tree metrics in the log line and on `/metrics` (a `vllm.stat_logger_plugins` logger).

vLLM's own spec-decode counters are already right for trees: one draft per round,
accepted tokens = the accepted path length L, so "mean acceptance length" is tau and the
per-position acceptance is the per-depth survival curve. Its "draft acceptance rate"
(L / nodes) means little for trees. This logger adds what trees need, from the same
scheduler statistics: verified nodes per round and the histogram of accepted depths.

Prometheus: `vllm:dartree_rounds_total`, `vllm:dartree_tree_nodes_total` and
`vllm:dartree_accepted_depth_total{depth="d"}` (rounds that accepted exactly d nodes);
and the worker's per-request state and drafter faults as gauges
(`vllm:dartree_live_request_state{kind}`, `vllm:dartree_drafter_faults{kind}`:
`engine.live_state`). Active only in engines started with a dartree speculative config.
"""

from __future__ import annotations

import logging

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_dartree.engine.live_state import register_collector, state_path
from vllm_dartree.engine.settings import KEY

__all__ = ["DARTreeStatLogger", "TreeStats"]

logger = logging.getLogger("vllm.dartree")
_PROM: dict = {}


def _prometheus():
    """The process's dartree Prometheus counters (created once: re-registering raises)."""
    if not _PROM:
        from prometheus_client import Counter
        _PROM["rounds"] = Counter("vllm:dartree_rounds", "Tree verification rounds",
                                  ["engine"])
        _PROM["nodes"] = Counter("vllm:dartree_tree_nodes", "Tree nodes verified by the target",
                                 ["engine"])
        _PROM["depth"] = Counter("vllm:dartree_accepted_depth",
                                 "Rounds by accepted depth (nodes accepted in the round)",
                                 ["engine", "depth"])
    return _PROM


class TreeStats:
    """Rounds, nodes and the accepted-depth histogram, accumulated from SpecDecodingStats."""

    def __init__(self) -> None:
        self.rounds = 0
        self.nodes = 0
        self.depths: list[int] = []   # depths[d] = rounds that accepted exactly d nodes

    def add(self, spec) -> tuple[int, int, list[int]]:
        """Add one step's stats; returns that step's (rounds, nodes, depth histogram)."""
        survival = [spec.num_drafts, *spec.num_accepted_tokens_per_pos]   # rounds with L >= d
        while len(survival) > 1 and survival[-1] == 0:
            survival.pop()
        hist = [survival[d] - (survival[d + 1] if d + 1 < len(survival) else 0)
                for d in range(len(survival))]
        self.rounds += spec.num_drafts
        self.nodes += spec.num_draft_tokens
        if len(self.depths) < len(hist):
            self.depths += [0] * (len(hist) - len(self.depths))
        for d, count in enumerate(hist):
            self.depths[d] += count
        return spec.num_drafts, spec.num_draft_tokens, hist

    def line(self) -> str:
        accepted = sum(d * c for d, c in enumerate(self.depths))
        return (f"DARTree: {self.rounds} rounds, {self.nodes / self.rounds:.1f} nodes/round, "
                f"mean accepted depth {accepted / self.rounds:.2f} "
                f"(tau {1 + accepted / self.rounds:.2f}), accepted-depth histogram "
                f"{dict((d, c) for d, c in enumerate(self.depths) if c)}")


class DARTreeStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0):
        extra = getattr(vllm_config, "additional_config", None) or {}
        self.active = isinstance(extra, dict) and KEY in extra
        self.engine = str(engine_index)
        self.window = TreeStats()
        if self.active:   # the worker's per-request state and drafter faults, as gauges
            register_collector(state_path(vllm_config), self.engine)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if not self.active or spec is None or not spec.num_drafts:
            return
        rounds, nodes, hist = self.window.add(spec)
        prom = _prometheus()
        prom["rounds"].labels(self.engine).inc(rounds)
        prom["nodes"].labels(self.engine).inc(nodes)
        for d, count in enumerate(hist):
            if count:
                prom["depth"].labels(self.engine, str(d)).inc(count)

    def log(self):
        if self.active and self.window.rounds:
            logger.info(self.window.line())
            self.window = TreeStats()

    def log_engine_initialized(self):
        if self.active:
            logger.info("DARTree tree speculation is on: tree metrics in this log and on "
                        "/metrics (vllm:dartree_*)")
