"""Code training prompts from local sources: deterministic, every task used, and no
function of the evaluation's code-edit set (bench.repetitive) among them."""

from vllm_dartree.bench.repetitive import repetitive_prompts
from vllm_dartree.zoo.code_prompts import TASKS, code_prompts


def test_code_prompts_are_deterministic_and_disjoint_from_the_evaluation():
    prompts = code_prompts(200)
    assert len(prompts) == 200 and prompts == code_prompts(200)
    assert len(set(prompts)) == 200
    openings = [t.split("\n")[0] for t in TASKS]
    assert {next(o for o in openings if p.startswith(o)) for p in prompts} == set(openings)
    everything = "\n".join(code_prompts())
    for item in repetitive_prompts("code-edit"):
        assert item.source[0] not in everything, item.id


def test_solve_prompts_are_humaneval_shaped_and_disjoint_from_the_evaluation():
    from vllm_dartree.bench.datasets import CODE_TEMPLATE
    from vllm_dartree.zoo.code_prompts import solve_prompts
    prompts = solve_prompts(150)
    assert len(prompts) == 150 and prompts == solve_prompts(150) and len(set(prompts)) == 150
    opening = CODE_TEMPLATE.split("{}")[0]
    assert all(p.startswith(opening) and p.endswith("\n```") for p in prompts)
    assert all('"""' in p or "'''" in p for p in prompts)      # a docstring to solve from
    heads = {p.split("```python\n")[1].split("\n")[0] for p in prompts}
    assert len(heads & {p.split("```python\n")[1].split("\n")[0] for p in code_prompts(150)}) < 30
    everything = "\n".join(solve_prompts())
    for item in repetitive_prompts("code-edit"):
        assert item.source[0] not in everything, item.id
