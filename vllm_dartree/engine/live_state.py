"""What the dartree worker holds per request, published for `/metrics` (gauges).

The worker (engine process) and the server's Prometheus registry (API-server process) share
no memory, and vLLM's scheduler statistics carry nothing of ours; so the worker writes a
small JSON file (atomically, whenever a count changes) named after the engine's
`instance_id`, and a Prometheus collector registered by the stat logger reads it at every
scrape. Gauges:

- `vllm:dartree_live_request_state{kind=...}`: requests with drafter context
  (`drafter_contexts`), committed rows waiting to extend it (`pending_contexts`,
  `engine.lazy_context`), proposed trees waiting for the scheduler (`stored_trees`), adaptive
  budget profiles and calibration corrections (`budget_requests`), lookup indices
  (`lookup_requests`), requests decoding without drafter context (`no_context_requests`).
  All 0 once every request has finished: anything else is a leak.
- `vllm:dartree_drafter_faults{kind=...}`: requests that decoded a step without a tree
  because the drafter raised (`draft_errors`) or returned an invalid tree (`invalid_trees`).
"""

from __future__ import annotations

import atexit
import json
import os
import tempfile
import time
from pathlib import Path

__all__ = ["LIVE_KINDS", "FAULT_KINDS", "state_path", "StatePublisher", "read_state",
           "register_collector"]

LIVE_KINDS = ("drafter_contexts", "pending_contexts", "stored_trees", "budget_requests",
              "lookup_requests", "no_context_requests")
FAULT_KINDS = ("draft_errors", "invalid_trees")
_REGISTERED: set[str] = set()


def state_path(vllm_config) -> Path | None:
    """The state file of an engine (None without an instance id)."""
    instance = getattr(vllm_config, "instance_id", "") or ""
    if not instance:
        return None
    safe = "".join(c for c in str(instance) if c.isalnum() or c in "-_")
    return Path(tempfile.gettempdir()) / f"vllm-dartree-state-{safe}.json"


class StatePublisher:
    """Writes the worker's counts when they change, at most every `min_interval` s (a write
    costs about 0.8 ms on this CPU, and with trees every other step the counts change every
    other step), at once when a request's state may have leaked (every live count back to
    0), when the worker turns busy again after such an idle write (so a burst shorter than
    `min_interval` is still seen), or when a fault was counted, and every `refresh` s if
    nothing changes."""

    def __init__(self, path: Path | None, refresh: float = 5.0, min_interval: float = 1.0):
        self.path, self.refresh, self.min_interval = path, refresh, min_interval
        self._last: dict | None = None
        self._written = 0.0
        if path is not None:
            atexit.register(self.close)

    def publish(self, state: dict[str, int]) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if state == self._last:
            if now - self._written < self.refresh:
                return
        elif now - self._written < self.min_interval and not self._urgent(state):
            return
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({**state, "pid": os.getpid(), "time": time.time()}))
            os.replace(tmp, self.path)
        except OSError:   # a read-only or full temp dir: metrics are not worth a crash
            self.path = None
            return
        self._last, self._written = dict(state), now

    def _urgent(self, state: dict[str, int]) -> bool:
        last = self._last or {}
        idle = not any(state.get(k, 0) for k in LIVE_KINDS)
        was_idle = not any(last.get(k, 0) for k in LIVE_KINDS)
        return (idle or was_idle
                or any(state.get(k, 0) != last.get(k, 0) for k in FAULT_KINDS))

    def close(self) -> None:
        if self.path is not None:
            try:
                self.path.unlink()
            except OSError:
                pass


def read_state(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def register_collector(path: Path | None, engine: str) -> None:
    """Register (once per process and file) the collector of the two gauge families."""
    if path is None or str(path) in _REGISTERED:
        return
    from prometheus_client import REGISTRY
    from prometheus_client.core import GaugeMetricFamily

    class LiveStateCollector:
        def collect(self):
            state = read_state(path)
            if state is None:   # nothing published yet: no sample, rather than a false 0
                return
            live = GaugeMetricFamily("vllm:dartree_live_request_state",
                                     "Per-request state held by the dartree worker "
                                     "(0 when no request is running)",
                                     labels=["engine", "kind"])
            faults = GaugeMetricFamily("vllm:dartree_drafter_faults",
                                       "Request-steps decoded without a tree because the "
                                       "drafter failed", labels=["engine", "kind"])
            for kind in LIVE_KINDS:
                live.add_metric([engine, kind], float(state.get(kind, 0)))
            for kind in FAULT_KINDS:
                faults.add_metric([engine, kind], float(state.get(kind, 0)))
            yield live
            yield faults

    REGISTRY.register(LiveStateCollector())
    _REGISTERED.add(str(path))
