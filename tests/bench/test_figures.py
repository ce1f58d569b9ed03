"""`python -m vllm_dartree.bench.figures --quick`: every reference-decoder and construction
figure drawn from a real (tiny) run, with the JSON it was drawn from; the throughput figure
from vLLM bench serve's result format."""

import json

import pytest

from vllm_dartree.bench.figures import CURVE_METHODS, QUICK_SWEEPS, draw_throughput, main


def test_quick_figures(tmp_path):
    out, work = tmp_path / "figures", tmp_path / "work"
    assert main(["--quick", "--out", str(out), "--workdir", str(work)]) == 0
    for name in ("acceptance", "sweeps", "construction"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "figures.json").read_text())
    runs = data["acceptance"]
    assert set(runs) == {m for m, _ in CURVE_METHODS}
    for r in runs.values():   # each curve is Pr(L >= t): non-increasing, from real rounds
        curve = r["acceptance_by_depth"]
        assert r["rounds"] > 0 and all(a >= b for a, b in zip(curve, curve[1:]))
        assert sum(r["accepted"].values()) == r["rounds"] == sum(r["tree_depths"].values())
        # one prompt in --quick: tau (a mean over requests) is 1 + the mean accepted length
        mean = sum(int(k) * v for k, v in r["accepted"].items()) / r["rounds"]
        assert r["tau"] == pytest.approx(1 + mean)
    for param, (values, _) in QUICK_SWEEPS.items():
        assert set(data["sweeps"][param]["DARTree pruned"]) == {str(v) for v in values}
    assert set(data["construction"]) == {"dartree-pruned", "dartree-fixed", "ddtree",
                                         "sequential-heap"}
    # resumable: a second run reads every run back instead of decoding again
    lines = (work / "runs.jsonl").read_text().count("\n")
    assert main(["--quick", "--out", str(out), "--workdir", str(work)]) == 0
    assert (work / "runs.jsonl").read_text().count("\n") == lines


def test_throughput_figure_from_bench_serve_results(tmp_path):
    results = {f"{m}@{c}": {"output_throughput": t * c ** 0.5}
               for m, t in (("plain", 9.0), ("dartree", 10.0)) for c in (1, 4, 16)}
    draw_throughput(results, tmp_path / "t.png", "caption")
    assert (tmp_path / "t.png").stat().st_size > 1000
