"""The shipped examples keep running: the demo and the GPU check's CPU smoke mode."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args, **env):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_tree_demo_is_lossless():
    out = _run(["examples/tree_demo.py", "--tokens", "60"])
    assert "equals the target's own greedy output" in out


def test_gpu_check_smoke_mode(tmp_path):
    out = _run(["examples/gpu_check.py", "--smoke"], OUT=str(tmp_path), TRITON_INTERPRET="1")
    assert "max kernel rel err" in out and (tmp_path / "gpu_check.json").exists()
    err = float(out.split("max kernel rel err:")[1].split()[0])
    assert err < 1e-4


def _load_example(name: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_report_compares_every_level_with_plain_decoding(capsys):
    """`make demo`'s report reads `run_interleaved`'s outputs per concurrency level (it once
    read that dict as a list: the answers failed to decode after the whole benchmark, and
    the identity check compared the levels' names)."""
    from types import SimpleNamespace
    report = _load_example("smollm2_demo").report
    questions = [SimpleNamespace(dataset="gsm8k", id=f"test:{i}", prompt=f"question {i}")
                 for i in range(2)]
    plain = {"1": [[5, 6], [7]], "4": [[5, 6], [7]]}
    results = {"plain": {"outputs": plain},
               "dartree": {"outputs": {"1": [[5, 6], [7]], "4": [[5, 6], [7]]}},
               "ngram": {"outputs": {"1": [[5, 6], [7]], "4": [[5, 6], [8]]}}}
    decode = lambda ids: " ".join(f"<{i}>" for i in ids)   # noqa: E731
    differ = report(questions, results, ["plain", "dartree", "ngram"], [1, 4], decode, 1)
    out = capsys.readouterr().out
    assert differ == ["ngram"]
    assert "<5> <6>" in out and "question 1" not in out          # one answer shown
    assert "dartree: answers identical to plain decoding: 4/4" in out
    assert "ngram: answers identical to plain decoding: 3/4" in out
