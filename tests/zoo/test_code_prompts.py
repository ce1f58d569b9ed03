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
