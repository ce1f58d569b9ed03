"""Per-round, per-request and aggregate statistics of speculative decoding.

tau follows the paper: tokens advanced per draft-verify round, bonus included (accepted + 1),
averaged per request, then averaged over requests (macro average).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field

__all__ = ["RoundStats", "RequestResult", "Summary", "summarize", "format_summary"]

STAGES = ("draft", "build", "verify", "commit")


@dataclass(frozen=True, slots=True)
class RoundStats:
    accepted: int         # draft tokens accepted this round (the bonus excluded)
    tree_nodes: int       # nodes the target verified
    tree_depth: int       # deepest node of the tree
    seconds: dict[str, float]   # stage -> seconds (draft, build, verify, commit)


@dataclass
class RequestResult:
    prompt_tokens: list[int]
    output_tokens: list[int]
    rounds: list[RoundStats] = field(default_factory=list)
    seconds: float = 0.0  # wall time after the prefill
    finish_reason: str = "length"   # "length" | "stop"

    @property
    def tau(self) -> float:
        if not self.rounds:
            return 1.0
        return sum(r.accepted + 1 for r in self.rounds) / len(self.rounds)


@dataclass
class Summary:
    method: str
    requests: int
    output_tokens: int
    tau: float                         # mean over requests of per-request tau
    acceptance_by_depth: list[float]   # Pr(L >= t), t = 1..max depth, over all rounds
    tree_depths: dict[int, int]        # histogram of tree depths
    mean_tree_nodes: float
    stage_seconds: dict[str, float]    # summed over requests
    tokens_per_second: float


def summarize(method: str, results: list[RequestResult]) -> Summary:
    rounds = [r for res in results for r in res.rounds]
    max_depth = max((r.tree_depth for r in rounds), default=0)
    accept = [sum(r.accepted >= t for r in rounds) / len(rounds) if rounds else 0.0
              for t in range(1, max_depth + 1)]
    stages = {s: sum(r.seconds.get(s, 0.0) for r in rounds) for s in STAGES}
    tokens = sum(len(res.output_tokens) for res in results)
    wall = sum(res.seconds for res in results)
    return Summary(
        method=method, requests=len(results), output_tokens=tokens,
        tau=sum(res.tau for res in results) / max(1, len(results)),
        acceptance_by_depth=accept,
        tree_depths=dict(sorted(Counter(r.tree_depth for r in rounds).items())),
        mean_tree_nodes=sum(r.tree_nodes for r in rounds) / max(1, len(rounds)),
        stage_seconds=stages, tokens_per_second=tokens / wall if wall else 0.0,
    )


def format_summary(summary: Summary, as_json: bool = False) -> str:
    if as_json:
        return json.dumps(asdict(summary), indent=2)
    total = sum(summary.stage_seconds.values())
    shares = ", ".join(f"{s} {100 * v / total:.0f}%" for s, v in summary.stage_seconds.items()) \
        if total else "n/a (no draft rounds)"
    accept = " ".join(f"{p:.2f}" for p in summary.acceptance_by_depth[:16])
    return "\n".join([
        f"method            {summary.method}",
        f"requests          {summary.requests} ({summary.output_tokens} output tokens)",
        f"tau               {summary.tau:.3f}",
        f"tokens/s          {summary.tokens_per_second:.2f}",
        f"tree nodes/round  {summary.mean_tree_nodes:.1f}",
        f"Pr(L >= t)        {accept}",
        f"tree depths       {summary.tree_depths}",
        f"stage time shares {shares}",
    ])
