"""The load script's short version (`python -m vllm_dartree.bench.load` on the tiny model):
two waves of streamed requests of every kind, a fifth dropped mid-stream, bad prompts; the
server stays up, answers greedy requests as the plain server does, and its per-request
state gauge moves during a wave and returns to 0 after it."""

import json

from vllm_dartree.bench.load import main


def test_load_waves_leave_no_state_and_match_plain(tiny, tmp_path):
    out = tmp_path / "report.json"
    code = main(["--target", str(tiny["target"]), "--drafter", str(tiny["drafter"]),
                 "--requests", "40", "--concurrency", "8", "--max-tokens", "12",
                 "--max-model-len", "256", "--workdir", str(tmp_path), "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["checks"] and all(report["checks"].values()), report["checks"]
    assert code == 0
    for wave in report["waves"]:
        assert wave["status"] == {"200": 36, "400": 4}
        assert wave["dropped"] == 7 and wave["greedy_checked"] == 18
        # every request holds lookup state while it runs; the drafter's context may stay
        # pending if the adaptive budget skips the drafter for the whole wave
        assert wave["live_state_peak"]["lookup_requests"] > 0
        assert (wave["live_state_peak"]["drafter_contexts"]
                + wave["live_state_peak"]["pending_contexts"]) > 0
