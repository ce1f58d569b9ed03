"""The reference decoder: every method is lossless against plain decoding."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from vllm_dartree.drafter import TargetInfo, load_drafter
from vllm_dartree.reference import (
    METHODS,
    DrafterSession,
    ReferenceDecoder,
    SamplingParams,
    method_config,
    summarize,
)
from vllm_dartree.testing import OracleDraftModel, write_tiny_drafter, write_tiny_target
from vllm_dartree.tree import MarkovToyHead

TREE_METHODS = [m for m in METHODS if m != "ar"]
SMALL = dict(budget=24, width=6, topk=16)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("ref")
    target_dir = write_tiny_target(root / "target", seed=1)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    info = TargetInfo(target.config.hidden_size, target.config.vocab_size,
                      target.config.num_hidden_layers)
    drafter = load_drafter(write_tiny_drafter(root / "domino", "domino", target_dir), info,
                           target.model.embed_tokens.weight, target.lm_head.weight,
                           dtype=torch.float32)
    return target, drafter


def _prompts(n=20):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(5, 1000, (int(length),), generator=gen).tolist()
            for length in torch.randint(1, 40, (n,), generator=gen)]


def test_ar_equals_transformers_generate(models):
    target, _ = models
    for prompt in _prompts(3):
        ours = ReferenceDecoder(target).generate(prompt, SamplingParams(max_new_tokens=12))
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert ours.output_tokens == ref[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def plain_outputs(models):
    params = SamplingParams(max_new_tokens=30)
    return [ReferenceDecoder(models[0]).generate(p, params).output_tokens for p in _prompts()]


@pytest.mark.parametrize("method", TREE_METHODS)
def test_greedy_is_lossless_for_every_method(models, plain_outputs, method):
    """20 prompts with the tiny random drafter, then the same 20 with an oracle drafter whose
    paths are accepted deep, with EOS and max_new_tokens cutting inside accepted paths."""
    target, drafter = models
    config = method_config(method, **SMALL)
    decoder = ReferenceDecoder(target, DrafterSession(drafter), config)
    for prompt, expected in zip(_prompts(), plain_outputs):
        decoder.draft_model = DrafterSession(drafter)
        got = decoder.generate(prompt, SamplingParams(max_new_tokens=16))
        assert got.output_tokens == expected[:16]
        assert all(r.tree_nodes <= max(24, drafter.spec.num_depths) for r in got.rounds)
    gen = torch.Generator().manual_seed(5)
    deep = 0
    for prompt, expected in zip(_prompts(), plain_outputs):
        cut = int(torch.randint(3, 30, (1,), generator=gen))
        eos = expected[int(torch.randint(1, 29, (1,), generator=gen))]
        stop = expected.index(eos) + 1
        decoder.draft_model = OracleDraftModel(target, 5)
        got = decoder.generate(prompt, SamplingParams(max_new_tokens=cut))
        assert got.output_tokens == expected[:cut]
        decoder.draft_model = OracleDraftModel(target, 5)
        got = decoder.generate(prompt, SamplingParams(max_new_tokens=30, eos_token_ids=(eos,)))
        assert got.output_tokens == expected[:stop]
        deep += sum(r.accepted == 5 for r in got.rounds)
    assert deep >= 20      # the oracle's paths were really accepted to full depth


@pytest.mark.parametrize("method", ["dflash", "dartree-pruned", "ddtree", "sequential-heap"])
def test_oracle_is_accepted_to_full_depth_and_stops_inside_paths(models, method):
    """The oracle's tree holds the target's greedy continuation: tau = depth + 1, which proves
    the mask, the positions and the KV compaction. EOS and max_new_tokens then land inside
    accepted paths and must cut exactly where plain decoding stops."""
    target, _ = models
    depth, prompt = 6, _prompts(1)[0]
    cfg = method_config(method, budget=16, width=4, topk=8)
    plain = ReferenceDecoder(target).generate(prompt, SamplingParams(max_new_tokens=1 + 3 * 7))
    oracle = ReferenceDecoder(target, OracleDraftModel(target, depth), cfg)
    full = oracle.generate(prompt, SamplingParams(max_new_tokens=1 + 3 * 7))
    assert full.output_tokens == plain.output_tokens
    assert full.tau == depth + 1 and [r.accepted for r in full.rounds] == [depth] * 3
    for cut in (5, 12):                                   # mid-round truncation
        oracle.draft_model = OracleDraftModel(target, depth)
        got = oracle.generate(prompt, SamplingParams(max_new_tokens=cut))
        assert got.output_tokens == plain.output_tokens[:cut]
    for k in (4, 10):                                     # EOS inside an accepted path
        eos = plain.output_tokens[k]
        stop = plain.output_tokens.index(eos)
        params = SamplingParams(max_new_tokens=30, eos_token_ids=(eos,))
        oracle.draft_model = OracleDraftModel(target, depth)
        got = oracle.generate(prompt, params)
        assert got.output_tokens == plain.output_tokens[:stop + 1]
        assert got.finish_reason == "stop"
        assert ReferenceDecoder(target).generate(prompt, params).output_tokens == got.output_tokens


@pytest.mark.parametrize("method", ["dartree-pruned", "ddtree", "dflash"])
def test_draft_vocabulary_tokens_outside_are_never_proposed(models, method):
    """A drafter with a reduced draft vocabulary that lacks some of the target's next
    tokens: those are never proposed, the chain stops there, output stays the target's."""
    target, _ = models
    depth, params = 6, SamplingParams(max_new_tokens=1 + 3 * 7)
    # a prompt whose continuation brings a new token at index k >= 2 (the tiny target
    # repeats itself): that token is left out of the draft vocabulary
    for prompt in _prompts(8):
        plain = ReferenceDecoder(target).generate(prompt, params).output_tokens
        k = next((i for i in range(2, 1 + depth) if plain[i] not in plain[1:i]), None)
        if k is not None:
            break
    assert k is not None
    ids = torch.tensor([t for t in range(target.config.vocab_size) if t != plain[k]])
    oracle = ReferenceDecoder(target, OracleDraftModel(target, depth, vocab_ids=ids),
                              method_config(method, budget=16, width=4, topk=8))
    got = oracle.generate(prompt, params)
    assert got.output_tokens == plain
    accepted = [r.accepted for r in got.rounds]
    assert 0 < sum(accepted) < depth * len(accepted)    # accepted, and cut where it left
    assert accepted[0] == min(k - 1, depth)             # plain[1 .. k-1]; never plain[k]


def test_kv_cache_after_rounds_equals_a_plain_forward(models):
    """After tree rounds with rejected branches, the target's cache holds exactly the
    committed tokens, as a plain causal forward over them computes."""
    from transformers import DynamicCache

    target, _ = models
    prompt, depth = _prompts(2)[1], 6
    cache = DynamicCache()
    decoder = ReferenceDecoder(target, OracleDraftModel(target, depth),
                               method_config("dartree-pruned", budget=16, width=4, topk=8))
    out = decoder.generate(prompt, SamplingParams(max_new_tokens=1 + 2 * (depth + 1)), cache)
    assert all(r.tree_nodes > r.accepted for r in out.rounds)       # branches were rejected
    committed = prompt + out.output_tokens[:-1]                      # the bonus has no KV yet
    plain = DynamicCache()
    with torch.no_grad():
        target(torch.tensor([committed]), past_key_values=plain, use_cache=True)
    assert cache.get_seq_length() == len(committed)
    for ours, ref in zip(cache.layers, plain.layers):
        torch.testing.assert_close(ours.keys, ref.keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.values, ref.values, rtol=1e-4, atol=1e-5)


class _RandomDrafter:
    """Fresh random draft logits every round + a first-order head: varied trees that often
    miss the target's mode."""

    layer_ids = (0,)

    def __init__(self, vocab, seed):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.head = MarkovToyHead(torch.randn(4, vocab, vocab, generator=self.gen),
                                  num_uncorrected=1)

    def extend(self, tokens, features):
        pass

    def draft(self, root):
        from vllm_dartree.drafter import DraftOutput
        return DraftOutput(None, 2 * torch.randn(1, 4, self.vocab, generator=self.gen))


def test_sampled_decoding_is_lossless():
    """First three tokens under DARTree at T = 1 follow the target's own distribution."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab, draws = 4, 2400
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    prompt = [1, 2, 3]
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=3):
            p = 1.0
            for i in range(3):
                logits = target(torch.tensor([prompt + list(seq[:i])])).logits[0, -1]
                p *= float(torch.softmax(logits.double(), -1)[seq[i]])
            probs[seq] = p
    config = method_config("dartree-pruned", budget=6, width=3, topk=3)
    counts = dict.fromkeys(probs, 0)
    for i in range(draws):
        decoder = ReferenceDecoder(target, _RandomDrafter(vocab, seed=i), config)
        out = decoder.generate(prompt, SamplingParams(max_new_tokens=3, temperature=1.0, seed=i))
        counts[tuple(out.output_tokens)] += 1
    observed = [counts[s] for s in probs]
    expected = [probs[s] * draws for s in probs]
    assert chisquare(observed, expected).pvalue > 1e-3


def test_summary_statistics(models):
    target, _ = models
    results = [ReferenceDecoder(target, OracleDraftModel(target, 4), method_config("dflash"))
               .generate(p, SamplingParams(max_new_tokens=11)) for p in _prompts(2)]
    summary = summarize("dflash", results)
    assert summary.tau == 5.0 and summary.acceptance_by_depth == [1.0, 1.0, 1.0, 1.0]
    assert summary.tree_depths == {4: 4} and summary.requests == 2


def test_llama_target_with_every_tree_shape():
    """The decoder is not Qwen-specific: a Llama target, greedy, trees of several builders."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    target = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(20)
    prompt, params = [5, 6, 7, 8], SamplingParams(max_new_tokens=20)
    expected = ReferenceDecoder(target).generate(prompt, params).output_tokens
    for method in ("dflash", "ddtree", "dartree-pruned", "dartree-fixed"):
        decoder = ReferenceDecoder(target, OracleDraftModel(target, 5),
                                   method_config(method, budget=12, width=3, topk=6))
        got = decoder.generate(prompt, params)
        assert got.output_tokens == expected, method
        assert got.rounds[0].accepted == 5
