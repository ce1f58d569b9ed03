"""The worker's state file: written when counts change, rate-limited, never late for a leak
check or a fault."""

import json

from vllm_dartree.engine import live_state
from vllm_dartree.engine.live_state import StatePublisher


def _state(**kw):
    base = {k: 0 for k in live_state.LIVE_KINDS + live_state.FAULT_KINDS}
    return {**base, **kw}


def test_publisher_rate_limits_changes_but_not_idle_or_faults(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(live_state.time, "monotonic", lambda: clock[0])
    path = tmp_path / "state.json"
    pub = StatePublisher(path, refresh=5.0, min_interval=1.0)
    read = lambda: {k: v for k, v in json.loads(path.read_text()).items()  # noqa: E731
                    if k not in ("pid", "time")}
    pub.publish(_state(stored_trees=1))
    assert read() == _state(stored_trees=1)                 # the first write
    clock[0] += 0.1
    pub.publish(_state(stored_trees=2))
    assert read() == _state(stored_trees=1)                 # a change within min_interval
    clock[0] += 0.1
    pub.publish(_state(stored_trees=2, draft_errors=1))
    assert read() == _state(stored_trees=2, draft_errors=1)  # a fault: at once
    clock[0] += 0.1
    pub.publish(_state())
    assert read() == _state()                               # idle (leak check): at once
    clock[0] += 0.1
    pub.publish(_state(drafter_contexts=3))
    assert read() == _state(drafter_contexts=3)             # busy again after idle: at once
    clock[0] += 0.1
    pub.publish(_state(drafter_contexts=4))
    assert read() == _state(drafter_contexts=3)             # rate-limited again ...
    clock[0] += 1.0
    pub.publish(_state(drafter_contexts=4))
    assert read() == _state(drafter_contexts=4)             # ... until min_interval
    path.write_text(json.dumps({"marker": 1}))
    clock[0] += 1.0
    pub.publish(_state(drafter_contexts=4))
    assert json.loads(path.read_text()) == {"marker": 1}    # unchanged: no write ...
    clock[0] += 5.0
    pub.publish(_state(drafter_contexts=4))
    assert read() == _state(drafter_contexts=4)             # ... until `refresh`
    pub.close()
    assert not path.exists()
