"""examples/engine_bench.py runs end to end (plain + oracle, two small levels) and prints a
table whose oracle rows reach tau = depth + 1 (and as many tokens per step), with vLLM's
engine processes and in-process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "engine_bench.py"


@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["processes", "in-process"])
def test_engine_bench_runs(tmp_path, mode):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--methods", "plain,oracle",
                           "--requests", "3", "--concurrency", "1,3", "--max-tokens", "16",
                           "--depth", "4", *mode], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines()
            if re.match(r"(plain|oracle)\s+\d", line)]
    assert [(r[0], r[1]) for r in rows] == [("plain", "1"), ("plain", "3"), ("oracle", "1"),
                                            ("oracle", "3")]
    assert all(r[4] == "5.00" for r in rows if r[0] == "oracle"), proc.stdout
    # tokens per decode step of a request: 15 tokens after the prefill's first, in 3 steps
    # of 5 for the oracle, 15 of 1 for plain decoding
    assert [r[5] for r in rows] == ["1.00", "1.00", "5.00", "5.00"], proc.stdout
    # the spread of the two repeats' ratios to plain decoding (lowest-highest)
    assert [r[6] for r in rows if r[0] == "plain"] == ["-", "-"], proc.stdout
    for r in rows:
        if r[0] == "oracle":
            low, high = map(float, r[6].split("-"))
            assert 0 < low <= high, proc.stdout
    assert ("(engines in-process)" in proc.stdout) == bool(mode)
