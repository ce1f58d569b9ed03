"""The adaptive budget's trace: what it planned each step, and what the step then cost and earned.

`VLLM_DARTREE_TRACE=FILE` makes the worker that drafts (rank 0) append one JSON line per
event to FILE (one engine per file):

- `plan`: the step's decision (`id`: 1, 2, ...): `running` requests, `nodes` planned in all, drafter `depth`
  (0: no drafter pass), `rate` (planned tokens/s) and `plain_rate` (the same cost model's
  tokens/s for a plain step), `explore`;
- `draft`: a drafter round (`requests`, `depths`, seconds `s`);
- `walk`: a verified tree (`nodes`, `predicted` and `observed` accepted tokens; `raw`: the
  calibrators' prediction before the plan's corrections; `conf`: the confidence bin its plan
  saw, or null);
- `step`: a decode step's seconds `s` without drafting, its `rows`, whether it verified
  trees, and `plan`: the `id` of the plan whose trees it verified.

`python -m vllm_dartree.engine.trace FILE` reads one back and prints, per number of running
requests and kind of step (plain, tree, explore), what those steps realized: the seconds
plain steps of the same batch would have taken for the same tokens (the mean plain step of
that size in the trace) against what they took, drafting included, beside what the plan
expected. Tree steps whose realized speed-up sits below 1 are steps the budget should not
have taken; a planned speed-up far from the realized one says which of its estimates (the
calibration: predicted vs observed tokens; the costs) is off. A second table gives, per
confidence bin, the trees verified, their calibrated (`raw`) and observed accepted tokens:
what the confidence factor learns from (`controller.confidence_factor`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = ["BudgetTrace", "TRACE_ENV", "read_trace", "summarize", "by_confidence", "main"]

TRACE_ENV = "VLLM_DARTREE_TRACE"


class BudgetTrace:
    """Appends events to a JSONL file (line-buffered: a killed engine loses nothing)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = None

    @classmethod
    def from_env(cls) -> BudgetTrace | None:
        path = os.environ.get(TRACE_ENV, "")
        return cls(path) if path else None

    def event(self, kind: str, **fields) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        fields = {k: v.item() if isinstance(v, np.generic) else v for k, v in fields.items()}
        self._file.write(json.dumps({"k": kind, "t": time.monotonic(), **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _steps(events: Iterable[dict]) -> list[dict]:
    """One record per plan: the plan, the draft it ran, the walks of the trees it made and
    the step that verified them. In the file an engine step writes the walks of the trees it
    verified, then its plan and draft (the next step's trees), then its own timing, tagged
    with the plan whose trees it verified (`plan`: that plan's `id`)."""
    records: dict[int, dict] = {}
    order: list[dict] = []
    latest = None
    for e in events:
        if e["k"] == "plan":
            latest = {"plan": e, "draft": 0.0, "walks": 0, "predicted": 0.0,
                      "observed": 0.0, "step": None}
            records[e["id"]] = latest
            order.append(latest)
        elif e["k"] == "step":
            record = records.get(e.get("plan"))
            if record is not None and record["step"] is None:
                record["step"] = e
        elif latest is None:
            continue
        elif e["k"] == "draft":
            latest["draft"] += e["s"]
        elif e["k"] == "walk":      # before the next plan: the latest plan's trees
            latest["walks"] += 1
            latest["predicted"] += e["predicted"]
            latest["observed"] += e["observed"]
    return [r for r in order if r["step"] is not None]


def summarize(events: Iterable[dict]) -> list[dict]:
    """Rows per (running requests, kind): steps, their seconds (drafting included), the
    plain-equivalent seconds of their tokens, realized and planned speed-ups, predicted and
    observed accepted tokens of their trees."""
    steps = _steps(events)
    plain: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        if not s["plan"]["nodes"] and not s["step"]["tree"]:
            plain[int(s["plan"]["running"])].append(s["step"]["s"])
    mean = {rows: float(np.mean(v)) for rows, v in plain.items()}
    groups: dict[tuple[int, str], dict] = {}
    for s in steps:
        p = s["plan"]
        running = int(p["running"])
        kind = "explore" if p.get("explore") else ("tree" if p["nodes"] else "plain")
        g = groups.setdefault((running, kind), {
            "running": running, "kind": kind, "steps": 0, "seconds": 0.0, "tokens": 0.0,
            "plain_seconds": 0.0, "planned": 0.0, "trees": 0, "predicted": 0.0,
            "observed": 0.0, "drafting": 0.0})
        tokens = running + s["observed"]
        g["steps"] += 1
        g["seconds"] += s["step"]["s"] + s["draft"]
        g["drafting"] += s["draft"]
        g["tokens"] += tokens
        base = mean.get(running)
        g["plain_seconds"] += np.nan if base is None else base * tokens / running
        g["planned"] += p["rate"] / p["plain_rate"] if p["plain_rate"] > 0 else np.nan
        g["trees"] += s["walks"]
        g["predicted"] += s["predicted"]
        g["observed"] += s["observed"]
    rows = []
    for key in sorted(groups):
        g = groups[key]
        g["realized"] = g["plain_seconds"] / g["seconds"] if g["seconds"] > 0 else np.nan
        g["planned"] /= g["steps"]
        rows.append(g)
    return rows


def by_confidence(events: Iterable[dict]) -> list[dict]:
    """Per confidence bin of the walks that carry one: trees, calibrated (`raw`) and observed
    accepted tokens."""
    from vllm_dartree.engine.controller import CONF_EDGES
    edges = [0.0, *CONF_EDGES.tolist(), 1.0]
    rows = {}
    for e in events:
        if e["k"] != "walk" or e.get("conf") is None or "raw" not in e:
            continue
        b = int(e["conf"])
        row = rows.setdefault(b, {"bin": b, "low": edges[b], "high": edges[b + 1], "trees": 0,
                                  "raw": 0.0, "observed": 0.0})
        row["trees"] += 1
        row["raw"] += e["raw"]
        row["observed"] += e["observed"]
    return [rows[b] for b in sorted(rows)]


def _format(rows: list[dict]) -> str:
    lines = [f"{'running':>7} {'kind':<8} {'steps':>6} {'seconds':>8} {'realized':>9} "
             f"{'planned':>8} {'trees':>6} {'pred/tree':>9} {'obs/tree':>9}"]
    for g in rows:
        trees = max(g["trees"], 1)
        realized = "-" if np.isnan(g["realized"]) else f"{g['realized']:.3f}x"
        lines.append(f"{g['running']:>7} {g['kind']:<8} {g['steps']:>6} {g['seconds']:>8.2f} "
                     f"{realized:>9} {g['planned']:>7.3f}x {g['trees']:>6} "
                     f"{g['predicted'] / trees:>9.2f} {g['observed'] / trees:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="What the adaptive budget planned and what its steps realized, from a "
                    f"trace written with {TRACE_ENV}=FILE.")
    parser.add_argument("trace", help="the JSONL file")
    args = parser.parse_args(argv)
    rows = summarize(read_trace(args.trace))
    if not rows:
        raise SystemExit(f"{args.trace}: no complete step in the trace")
    print("realized: the seconds plain steps of the same batch size (the trace's mean) "
          "would take\nfor the same tokens, over the seconds these steps took (drafting "
          "included); planned: the\nplan's own expectation. pred/obs per tree: accepted "
          "tokens predicted and observed.")
    print(_format(rows))
    conf = by_confidence(read_trace(args.trace))
    if conf:
        print("\nby the target's confidence at the row before the tree (its top probability): "
              "trees,\naccepted tokens per tree as calibrated (before the plan's corrections) "
              "and observed")
        print(f"{'confidence':<11} {'trees':>6} {'raw/tree':>9} {'obs/tree':>9} {'obs/raw':>8}")
        for r in conf:
            print(f"{r['low']:.2f}-{r['high']:.2f}  {r['trees']:>6} "
                  f"{r['raw'] / r['trees']:>9.2f} {r['observed'] / r['trees']:>9.2f} "
                  f"{r['observed'] / max(r['raw'], 1e-9):>8.2f}")


if __name__ == "__main__":
    main()
