"""The budget's trace (`VLLM_DARTREE_TRACE`): the events a TreeBudget writes, and the
summary's arithmetic on a hand-made trace (pure numpy: no engine)."""

import json

import numpy as np
import pytest

from vllm_dartree.engine.controller import TreeBudget
from vllm_dartree.engine.costs import StepCosts
from vllm_dartree.engine.trace import by_confidence, main, read_trace, summarize


class _Engine:
    """Events in an engine's order: each step writes its walks (of the last plan's trees),
    its plan and draft, then its own timing tagged with the plan it verified."""

    def __init__(self):
        self.events, self.plans = [], 0

    def step(self, seconds, rows, tree=False, walks=(), plan=None, draft=None):
        self.events += [{"k": "walk", "t": 0.0, "nodes": 2, "predicted": p, "observed": o}
                        for p, o in walks]
        verified = self.plans
        if plan is not None:
            self.plans += 1
            running, nodes, rate, plain_rate, explore = plan
            self.events.append({"k": "plan", "t": 0.0, "id": self.plans, "running": running,
                                "requests": running, "nodes": nodes, "depth": 2 if nodes else 0,
                                "rate": rate, "plain_rate": plain_rate, "explore": explore})
        if draft is not None:
            self.events.append({"k": "draft", "t": 0.0, "requests": 1, "depths": 2, "s": draft})
        self.events.append({"k": "step", "t": 0.0, "plan": verified, "rows": rows,
                            "tree": tree, "s": seconds})


def test_summary_against_hand_arithmetic():
    e = _Engine()
    e.step(0.5, 8, plan=(2, 0, 20.0, 20.0, False))     # a prefill-like first step: no plan before
    for s in (0.10, 0.11, 0.12):                      # plain steps of 2 requests: mean 0.11
        e.step(s, 2, plan=(2, 0 if s < 0.12 else 4, 20.0 if s < 0.12 else 30.0, 20.0, False),
               draft=None if s < 0.12 else 0.02)
    # the tree step: verifies the 4-node plan's two trees (2 + 1 accepted of 3.5 predicted)
    e.step(0.13, 6, tree=True, walks=[(2.0, 2.0), (1.5, 1.0)], plan=(2, 2, 20.0, 20.0, True),
           draft=0.03)
    e.step(0.11, 4, tree=True, walks=[(0.5, 0.0)], plan=(3, 0, 25.0, 25.0, False))
    rows = {(g["running"], g["kind"]): g for g in summarize(e.events)}
    assert set(rows) == {(2, "plain"), (2, "tree"), (2, "explore")}   # the last plan: no step
    plain, tree, explore = rows[2, "plain"], rows[2, "tree"], rows[2, "explore"]
    # plans 1-3 (plain) were verified by the steps of 0.10, 0.11 and 0.12 s: mean 0.11
    assert plain["steps"] == 3 and plain["realized"] == pytest.approx(1.0)
    # plan 4: 2 + 3 tokens in 0.13 s and its 0.02 s draft, against 0.11 s per 2 plain tokens
    assert tree["steps"] == 1 and tree["tokens"] == 5
    assert tree["realized"] == pytest.approx(0.11 * 5 / 2 / 0.15)
    assert tree["planned"] == pytest.approx(1.5)
    assert (tree["trees"], tree["predicted"], tree["observed"]) == (2, 3.5, 3.0)
    # plan 5, an exploration: 2 tokens in 0.11 + 0.03 s
    assert explore["realized"] == pytest.approx(0.11 / 0.14)
    assert explore["drafting"] == pytest.approx(0.03)


def test_a_batch_size_without_plain_steps_has_no_realized_figure():
    e = _Engine()
    e.step(0.1, 5, plan=(5, 3, 30.0, 20.0, False), draft=0.01)
    e.step(0.2, 8, tree=True, walks=[(1.0, 1.0)], plan=(5, 3, 30.0, 20.0, False))
    rows = summarize(e.events)
    assert len(rows) == 1 and np.isnan(rows[0]["realized"])


def test_tree_budget_writes_its_trace(tmp_path, monkeypatch, capsys):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("VLLM_DARTREE_TRACE", str(path))
    monkeypatch.setenv("VLLM_DARTREE_CONFIDENCE", "1")
    budget = TreeBudget(max_nodes=6, max_depth=6)
    budget.costs = StepCosts(plain_step=0.05)
    scores, depths = -0.1 * np.arange(1, 7), np.arange(1, 7)
    pending = 0                            # the last plan's tree, verified by the next step
    for k in range(30):                    # a drafter that is always right, in engine order
        verified, rows = budget.stats["steps"], 1 + pending
        if pending:
            budget.observe_walk("a", True, scores[:pending], depths[:pending],
                                list(range(pending)))
        # the target's confidence: alternately 0.99 and none (a step without one)
        plan = budget.plan(["a"], [True], 1, confidence=[0.99 if k % 2 else None])
        pending = 0
        if plan.nodes[0]:
            budget.observe_draft(1, plan.depth, 0.01)
            pending = budget.cut("a", True, scores, depths, plan, 0)
        budget.observe_step(rows, rows > 1, 0.05 + 0.005 * (rows - 1), plan=verified,
                            nodes=rows - 1)
    budget.trace.close()
    events = read_trace(path)
    kinds = [e["k"] for e in events]
    assert kinds.count("plan") == 30 and kinds.count("step") == 30
    assert kinds.count("walk") == budget.stats["rounds"] > 0
    walks = [e for e in events if e["k"] == "walk"]
    assert sum(e["observed"] for e in walks) == pytest.approx(budget.stats["observed_accepted"])
    assert sum(e["predicted"] for e in walks) == pytest.approx(
        budget.stats["predicted_accepted"])
    plans = [e for e in events if e["k"] == "plan"]
    assert all(e["plain_rate"] > 0 and e["rate"] >= e["plain_rate"] * (1 - 1e-9)
               for e in plans)
    assert all(json.dumps(e) for e in events)
    # every verifying step is tied to the plan whose trees it verified
    summary = summarize(events)
    assert sum(g["trees"] for g in summary) == budget.stats["rounds"]
    assert {g["kind"] for g in summary} >= {"explore", "tree"}
    # walks of trees planned with a confidence carry its bin and the calibrators' raw
    # prediction; the per-bin table adds them up
    booked = [e for e in walks if e["conf"] is not None]
    assert booked and all(e["conf"] == 5 for e in booked)
    assert all(e["conf"] is None for e in walks if e not in booked)
    conf = by_confidence(events)
    assert [r["bin"] for r in conf] == [5] and conf[0]["trees"] == len(booked)
    assert conf[0]["raw"] == pytest.approx(sum(e["raw"] for e in booked))
    assert conf[0]["observed"] == pytest.approx(sum(e["observed"] for e in booked))
    main([str(path)])
    printed = capsys.readouterr().out
    assert "realized" in printed and " tree " in printed and "0.95-1.00" in printed


def test_no_trace_without_the_variable(monkeypatch):
    monkeypatch.delenv("VLLM_DARTREE_TRACE", raising=False)
    assert TreeBudget(max_nodes=4, max_depth=4).trace is None
