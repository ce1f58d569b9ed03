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
