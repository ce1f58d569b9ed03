"""DARTree inside vLLM (`LLM.generate`): token-identical to the same engine without
speculation, for every builder, with chunked prefill, preemption, EOS / max_tokens inside
accepted paths; tau = depth + 1 with an oracle drafter; parity with the reference decoder;
seeded sampling reproducible and distributed as the target's."""

import json
import os

import pytest
import torch
from scipy.stats import chi2_contingency

from tests.engine.conftest import TREE, dartree_spec, engine_kwargs, mixed_prompts, run_job
from vllm_dartree.config import DARTreeConfig

# Chunked prefill (160 tokens per step < the 300-token prompt) and a KV cache too small for
# 8 running requests (preemption), the same for the plain engine and the speculative ones.
BATCHED = dict(max_num_seqs=8, max_num_batched_tokens=160, block_size=32,
               num_gpu_blocks_override=24)
# the adaptive budget's drafts depend on measured step times, so dartree8's preemption must
# not: 17 blocks x 32 slots (the least vLLM accepts for max_model_len 512) hold the
# 300-token request and too little beside it
DARTREE8_KV = dict(num_gpu_blocks_override=17)
ORACLE_DEPTH = 8
SAMPLED = dict(temperature=0.8, top_p=0.95, max_tokens=3, ignore_eos=True)
NUM_SAMPLES = 400


def _greedy(prompts):
    return [dict(max_tokens=8 + (i * 7) % 41, temperature=0.0) for i in range(len(prompts))]


SAMPLED_PROMPT = [11, 402, 87, 233, 5, 640]


def _sampled_batch():
    prompt = SAMPLED_PROMPT
    return {"prompts": [prompt] * NUM_SAMPLES,
            "params": [dict(SAMPLED, seed=1000 + i) for i in range(NUM_SAMPLES)]}


def _features_batch(prompts):
    """Requests that need vLLM's full sampler, in a batch with plain greedy ones."""
    params = [dict(max_tokens=12, temperature=0.0, logprobs=2),
              dict(max_tokens=12, temperature=0.0, repetition_penalty=1.3),
              dict(max_tokens=12, temperature=0.0, presence_penalty=0.7),
              dict(max_tokens=12, temperature=0.0, frequency_penalty=0.5),
              dict(max_tokens=12, temperature=0.0),
              dict(max_tokens=30, temperature=0.0)]
    return {"prompts": prompts[:len(params)], "params": params}


def _seeded_long_batch(prompts):
    """Seeded requests on the 300-token prompt: chunked at 160 tokens under BATCHED."""
    return {"prompts": [prompts[-1]] * 3,
            "params": [dict(max_tokens=8, temperature=0.8, seed=s) for s in (1, 2, 3)]}


def _fallback_batch(prompts):
    """_features_batch + extra_args + 4 greedy requests (test_full_sampler_requests_...)."""
    params = _features_batch(prompts)["params"]          # 4 need vLLM's sampler
    params += [dict(max_tokens=12, temperature=0.0, extra_args={"anything": 1})]
    params += [dict(max_tokens=24, temperature=0.0) for _ in range(4)]
    return {"prompts": prompts[:len(params)], "params": params}


def _oracle_file(path, plain, oracle_prompts, **options):
    """The oracle's JSON: the plain engine's long greedy continuations (+ its options)."""
    table = [[p, out["tokens"]] for p, out in zip(oracle_prompts, plain["batches"][1])]
    path.write_text(json.dumps({"depth": ORACLE_DEPTH, "layer_ids": [1, 3],
                                "continuations": table, **options}))
    return path


ORACLE = "vllm_dartree.engine.drafters.OracleTreeDrafter"


def _tokens(batch):
    return [r["tokens"] for r in batch]


def _assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"{what}: request {i} differs at token " \
            f"{next(k for k in range(min(len(g), len(w)) + 1) if g[k:k + 1] != w[k:k + 1])}"


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts()


@pytest.fixture(scope="module")
def oracle_prompts(prompts):
    return prompts[:12]


@pytest.fixture(scope="module")
def plain(tiny, prompts, oracle_prompts, tmp_path_factory):
    """The engine without speculation: greedy outputs, oracle continuations, samples."""
    main = {"prompts": prompts, "params": _greedy(prompts)}
    long = {"prompts": oracle_prompts,
            "params": [dict(p, max_tokens=p["max_tokens"] + ORACLE_DEPTH + 1, ignore_eos=True)
                       for p in _greedy(oracle_prompts)]}
    return run_job(tmp_path_factory.mktemp("plain"), engine_kwargs(tiny["target"], **BATCHED),
                   [main, long, _sampled_batch(), _features_batch(prompts),
                    _fallback_batch(oracle_prompts),
                    {"prompts": [SAMPLED_PROMPT],     # the sampled oracle's continuation
                     "params": [dict(max_tokens=SAMPLED["max_tokens"] + ORACLE_DEPTH + 1,
                                     temperature=0.0, ignore_eos=True)]}])


@pytest.fixture(scope="module")
def dartree8(tiny, prompts, tmp_path_factory):
    """The defaults (adaptive budget, lookup) under BATCHED, with a KV cache small enough
    that the prompts alone force preemption however few nodes the budget drafts."""
    engine = engine_kwargs(tiny["target"], **{**BATCHED, **DARTREE8_KV},
                           speculative_config=dartree_spec(tiny["drafter"]))
    sampled = _sampled_batch()
    return run_job(tmp_path_factory.mktemp("dartree8"), engine,
                   [{"prompts": prompts, "params": _greedy(prompts)}, sampled, sampled,
                    _features_batch(prompts), _seeded_long_batch(prompts)])


def test_dartree_greedy_equals_plain_batched(plain, dartree8):
    _assert_same(_tokens(dartree8["batches"][0]), _tokens(plain["batches"][0]), "dartree, 8 seqs")
    counters = dartree8["counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters.get("vllm:num_preemptions", 0) > 0, "the KV budget did not force preemption"


def _one_seq_subset(prompts):
    """Nine short prompts and the 300-token one."""
    return prompts[:9] + prompts[-1:]


@pytest.fixture(scope="module")
def one_seq(tiny, prompts, tmp_path_factory):
    """max_num_seqs 1, the fixed budget without lookup (the reference decoder's trees), and
    no chunking (the seeded batch's unchunked run)."""
    subset = _one_seq_subset(prompts)
    engine = engine_kwargs(tiny["target"], max_num_seqs=1, max_num_batched_tokens=2048,
                           speculative_config=dartree_spec(tiny["drafter"], adaptive=False,
                                                           lookup=False),
                           per_request_spec_decode_metrics="detailed")
    return run_job(tmp_path_factory.mktemp("one-seq"), engine,
                   [{"prompts": subset, "params": [_greedy(prompts)[i] for i in
                                                   list(range(9)) + [len(prompts) - 1]]},
                    _seeded_long_batch(prompts)])


def test_dartree_greedy_equals_plain_one_seq_and_matches_reference(tiny, plain, prompts,
                                                                   one_seq):
    """max_num_seqs 1: plain decoding's tokens, and the reference decoder's outputs and
    per-round accepted lengths."""
    subset = _one_seq_subset(prompts)
    params_all = _greedy(prompts)
    params = [params_all[i] for i in list(range(9)) + [len(prompts) - 1]]
    batch = one_seq["batches"][0]
    want = plain["batches"][0]
    _assert_same(_tokens(batch), _tokens(want[:9] + want[-1:]), "dartree, 1 seq")

    from transformers import AutoModelForCausalLM

    from vllm_dartree.drafter import TargetInfo, load_drafter
    from vllm_dartree.reference import DrafterSession, ReferenceDecoder, SamplingParams
    target = AutoModelForCausalLM.from_pretrained(tiny["target"], dtype=torch.float32).eval()
    cfg = target.config
    drafter = load_drafter(tiny["drafter"], TargetInfo(cfg.hidden_size, cfg.vocab_size,
                                                       cfg.num_hidden_layers),
                           target.model.embed_tokens.weight, target.lm_head.weight,
                           dtype=torch.float32)
    decoder = ReferenceDecoder(target, DrafterSession(drafter), DARTreeConfig(**TREE))
    eos = (cfg.eos_token_id,)
    for prompt, params, res in zip(subset, params, batch):
        ref = decoder.__class__(target, DrafterSession(drafter), decoder.config).generate(
            prompt, SamplingParams(max_new_tokens=params["max_tokens"], eos_token_ids=eos))
        assert res["tokens"] == ref.output_tokens
        assert res["spec"]["per_step_accepted"] == [r.accepted for r in ref.rounds]


@pytest.mark.parametrize("builder,budget,draft_vocab,dtype", [
    ("ddtree", TREE["budget"], 0, "auto"), ("chain", 6, 0, "float32"),
    ("dartree", TREE["budget"], 96, "bfloat16")])
def test_baseline_builders_equal_plain(tiny, plain, prompts, builder, budget, draft_vocab,
                                       dtype, tmp_path):
    """The chain at a budget below the drafter's 16 depths: it is cut at the budget (it once
    handed vLLM 16 drafts for 6 per-position counters and killed the engine). A drafter with
    a reduced draft vocabulary (96 tokens) drafts target ids through the engine's builder,
    in bfloat16 beside the fp32 target (`drafter_dtype`; the chain's drafter in fp32, the
    DDTree case's `auto`: bf16 on a CPU with AMX, fp32 elsewhere)."""
    from vllm_dartree.testing import write_tiny_drafter
    drafter = tiny["drafter"]
    if draft_vocab:
        drafter = write_tiny_drafter(tmp_path / "draft-vocab", "domino", tiny["target"],
                                     draft_vocab=draft_vocab)
    spec = dartree_spec(drafter, builder=builder, budget=budget, drafter_dtype=dtype)
    engine = engine_kwargs(tiny["target"], **BATCHED, speculative_config=spec)
    subset = prompts[:15] + prompts[-1:]     # 16 requests for 8 slots; the chunked prompt
    params = _greedy(prompts)
    params = params[:15] + params[-1:]
    got = run_job(tmp_path, engine, [{"prompts": subset, "params": params}])
    want = plain["batches"][0]
    _assert_same(_tokens(got["batches"][0]), _tokens(want[:15] + want[-1:]), builder)
    assert got["counters"]["vllm:spec_decode_num_drafts"] > 0


@pytest.mark.parametrize("attention", ["sdpa", "paged"])
def test_oracle_drafter_reaches_full_depth(tiny, plain, oracle_prompts, tmp_path, attention):
    """A drafter whose tree holds the target's greedy continuation: every round accepts
    ORACLE_DEPTH nodes in vLLM's own counters (positions, masks and compaction are right),
    and stop tokens / max_tokens that fall inside accepted paths end requests exactly.
    `paged`: the same with the GPU backend's metadata builder and impl (device-side tree
    inputs, vLLM's KV tensor read through the paged kernel's torch reference)."""
    table = [[p, out["tokens"]] for p, out in zip(oracle_prompts, plain["batches"][1])]
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"depth": ORACLE_DEPTH, "layer_ids": [1, 3],
                                  "continuations": table}))
    params = _greedy(oracle_prompts)
    for i in range(0, len(params), 3):   # a stop token that appears inside the output
        params[i]["stop_token_ids"] = [table[i][1][min(5, params[i]["max_tokens"] - 2)]]
    spec = dartree_spec(oracle, drafter_class="vllm_dartree.engine.drafters.OracleTreeDrafter",
                        budget=2 * ORACLE_DEPTH, adaptive=False)
    got = run_job(tmp_path, engine_kwargs(tiny["target"], max_num_seqs=4,
                                          speculative_config=spec),
                  [{"prompts": oracle_prompts, "params": params}],
                  env={"VLLM_DARTREE_CPU_ATTENTION": attention})
    want = []
    for (prompt, full), p in zip(table, params):
        out = full[:p["max_tokens"]]
        stop = p.get("stop_token_ids", [None])[0]
        want.append(out[:out.index(stop) + 1] if stop in out else out)
    _assert_same(_tokens(got["batches"][0]), want, "oracle")
    c = got["counters"]
    tau = 1 + c["vllm:spec_decode_num_accepted_tokens"] / c["vllm:spec_decode_num_drafts"]
    assert tau == ORACLE_DEPTH + 1
    per_pos = c["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos[:ORACLE_DEPTH] == [c["vllm:spec_decode_num_drafts"]] * ORACLE_DEPTH


def test_logprobs_and_penalties_equal_plain(plain, dartree8):
    """Requests with logprobs or penalties share a batch with tree requests (chunked
    prefill, preemption): vLLM's sampler serves them from their root rows, so every output
    stays the target's."""
    got, want = dartree8["batches"][3], plain["batches"][3]
    _assert_same(_tokens(got), _tokens(want), "logprobs / penalties")
    assert got[0]["logprobs"] == want[0]["logprobs"] == 12


def test_full_sampler_requests_fall_back_alone(tiny, plain, oracle_prompts, tmp_path):
    """Requests that need vLLM's sampler (logprobs, penalties, `extra_args`) share a batch
    with greedy ones under the oracle drafter: they decode without trees and are exactly
    plain decoding's (tokens and logprob values), while the others keep their trees and
    accept drafts (they once switched speculation off for the whole batch)."""
    batch = _fallback_batch(oracle_prompts)
    needs_sampler = {0, 1, 2, 3, 6}
    spec = dartree_spec(_oracle_file(tmp_path / "oracle.json", plain, oracle_prompts),
                        drafter_class=ORACLE, budget=2 * ORACLE_DEPTH, adaptive=False)
    got = run_job(tmp_path, engine_kwargs(tiny["target"], **BATCHED,
                                          speculative_config=spec,
                                          per_request_spec_decode_metrics="detailed"),
                  [batch])["batches"][0]
    want = plain["batches"][4]
    _assert_same(_tokens(got), _tokens(want), "vLLM-sampler requests beside trees")
    assert got[0]["logprobs"] == 12
    assert got[0]["logprob_values"] == pytest.approx(want[0]["logprob_values"], abs=1e-4)
    for i, res in enumerate(got):
        spec_metrics = res["spec"] or {}
        if i in needs_sampler:
            assert spec_metrics.get("num_draft_tokens", 0) == 0, \
                f"request {i} needs vLLM's sampler but was proposed a tree"
        else:
            assert spec_metrics.get("num_accepted_draft_tokens", 0) > 0, \
                f"greedy request {i} lost its trees to its neighbours"


TP2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp")


@pytest.mark.parametrize("options,tree,parallel", [
    # 3 siblings, the right one anywhere, chains cut at random depths, the fixed budget, on
    # two tensor-parallel ranks (rank 0 drafts and broadcasts its trees; both ranks mask
    # and compact the same nodes of their KV-head shards)
    (dict(siblings=3, shuffle=1, random_depth=True), dict(adaptive=False), TP2),
    # 4 siblings x 8 depths = 32 nodes cut at a budget of 12 (fixed: the adaptive budget
    # sizes these trees from measured step times, and on a loaded machine it may keep them
    # to a node or two, which the counter check below cannot tell from a broken shape)
    (dict(siblings=4, shuffle=2), dict(budget=12, adaptive=False), {}),
], ids=["3-siblings-random-depth-tp2", "4-siblings-cut-at-12"])
def test_shuffled_oracle_trees_are_accepted_and_exact(tiny, plain, oracle_prompts, options,
                                                      tree, parallel, tmp_path):
    """Oracle trees of other shapes (the right child at a random sibling position, random
    depth cut-offs, wide trees cut by the budget and by the scheduler's token budget, with
    chunked prefill and preemption, one case at tensor_parallel_size = 2): drafts are
    accepted (vLLM's counters) and the output is (TP = 1) plain decoding's."""
    spec = dartree_spec(_oracle_file(tmp_path / "oracle.json", plain, oracle_prompts,
                                     **options),
                        drafter_class=ORACLE, **{"budget": 2 * ORACLE_DEPTH, **tree})
    params = _greedy(oracle_prompts)
    got = run_job(tmp_path, engine_kwargs(tiny["target"], **BATCHED, **parallel,
                                          speculative_config=spec),
                  [{"prompts": oracle_prompts, "params": params}])
    _assert_same(_tokens(got["batches"][0]), _tokens(plain["batches"][0][:len(params)]),
                 f"oracle {options} {parallel}")
    c = got["counters"]
    assert c["vllm:spec_decode_num_accepted_tokens"] > c["vllm:spec_decode_num_drafts"], \
        "fewer than one accepted token per round: the shapes were not exercised"


def test_drafter_faults_cost_one_tree_not_the_engine(tiny, plain, oracle_prompts, tmp_path):
    """A drafter that raises, or returns NaN scores, an empty tree, a parent after its
    child or a token outside the vocabulary, for one request every other round: the engine
    lives, every output is plain decoding's, the faults are counted, and the other
    requests keep accepting drafts."""
    kinds = ["raise", "nan", "empty", "bad_parent", "bad_token"]
    faults = [{"kind": kind, "prompt": i, "every": 2} for i, kind in enumerate(kinds)]
    spec = dartree_spec(_oracle_file(tmp_path / "oracle.json", plain, oracle_prompts,
                                     faults=faults),
                        drafter_class=ORACLE, budget=2 * ORACLE_DEPTH, adaptive=False)
    params = _greedy(oracle_prompts)
    got = run_job(tmp_path, engine_kwargs(tiny["target"], max_num_seqs=12,
                                          speculative_config=spec,
                                          per_request_spec_decode_metrics="detailed"),
                  [{"prompts": oracle_prompts, "params": params}])
    batch = got["batches"][0]
    _assert_same(_tokens(batch), _tokens(plain["batches"][0][:len(params)]), "faulty drafter")
    assert got["budget"]["draft_errors"] > 0
    assert got["budget"]["invalid_trees"] > 0
    healthy = [r for r in batch[len(kinds):] if len(r["tokens"]) > 2]
    assert healthy and all(r["spec"]["num_accepted_draft_tokens"] > 0 for r in healthy)


def test_tensor_parallel_2_checkpoint_drafter(tiny, plain, oracle_prompts, tmp_path):
    """TP = 2 with a checkpoint drafter: rank 0's drafter holds the target's full embedding
    and lm-head (gathered from the two vocabulary shards: the same row-weighted sums as the
    checkpoint's own tables), rank 1 holds no drafter, and greedy output is TP = 1 plain's."""
    from safetensors.torch import load_file
    params = _greedy(oracle_prompts)
    got = run_job(tmp_path, engine_kwargs(tiny["target"], **TP2,
                                          speculative_config=dartree_spec(tiny["drafter"])),
                  [{"prompts": oracle_prompts, "params": params}],
                  env={"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, drafter_tables=True)
    _assert_same(_tokens(got["batches"][0]), _tokens(plain["batches"][0][:len(params)]),
                 "TP=2 checkpoint drafter")
    leader, follower = got["drafter_tables"]
    assert follower is None
    weights = load_file(str(tiny["target"] / "model.safetensors"))
    for (rows, total), name in zip(leader, ("model.embed_tokens.weight", "lm_head.weight")):
        w = weights[name].double()
        index = torch.arange(1, w.shape[0] + 1, dtype=torch.float64)[:, None]
        assert rows == w.shape[0]
        assert total == pytest.approx(float((w * index).sum()), rel=1e-9, abs=1e-6)


BAN_PLUGIN = """
from vllm.v1.sample.logits_processor import LogitsProcessor


class BanToken(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        logits[:, {banned}] = float("-inf")
        return logits
"""


def test_logits_processor_plugins_apply_as_in_plain_decoding(tiny, plain, prompts, tmp_path):
    """A logits processor installed as a plugin (entry point `vllm.logits_processors`)
    that bans a token: vLLM drops such plugins when speculation is on; dartree installs them
    and samples every request with vLLM's sampler, so outputs equal plain decoding's with
    the plugin (and differ from plain decoding without it)."""
    subset, params = prompts[:6], _greedy(prompts)[:6]
    banned = plain["batches"][0][0]["tokens"][1]
    site = tmp_path / "site"
    info = site / "ban_token-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "ban_token.py").write_text(BAN_PLUGIN.format(banned=banned))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ban-token\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vllm.logits_processors]\nban = ban_token:BanToken\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    batch = [{"prompts": subset, "params": params}]
    got = run_job(tmp_path, engine_kwargs(tiny["target"],
                                          speculative_config=dartree_spec(tiny["drafter"])),
                  batch, env=env)
    # plain greedy decoding with the token banned, in transformers (the tiny target's
    # greedy paths are vLLM's: see the reference-decoder test above)
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    class Ban:
        def __call__(self, input_ids, scores):
            scores[:, banned] = float("-inf")
            return scores

    model = AutoModelForCausalLM.from_pretrained(tiny["target"], dtype=torch.float32).eval()
    want = []
    for prompt, sp in zip(subset, params):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=sp["max_tokens"],
                             do_sample=False, logits_processor=LogitsProcessorList([Ban()]),
                             eos_token_id=model.config.eos_token_id, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    got = _tokens(got["batches"][0])
    assert want != _tokens(plain["batches"][0][:6]), "the plugin did not act"
    assert all(banned not in t for t in want)
    _assert_same(got, want, "logits processor plugin")


def test_seeded_requests_survive_chunked_prefill(prompts, dartree8, one_seq):
    """A seeded request whose prompt is chunked samples (and discards) a token per partial
    chunk; vLLM rewinds its generator with `set_offset`, which CPU generators lack (stock
    vLLM on CPU dies: "CPU Generator does not use offset"). The plugin restores the
    generator's state instead: the engine lives, and the tokens equal an unchunked run's
    (seeded draws depend on the seed and position only, not on the tree or the batch)."""
    assert len(prompts[-1]) > BATCHED["max_num_batched_tokens"]
    assert _tokens(dartree8["batches"][4]) == _tokens(one_seq["batches"][1])


def test_seeded_sampling_is_reproducible(plain, dartree8):
    assert _tokens(dartree8["batches"][1]) == _tokens(dartree8["batches"][2])
    # the first token comes from the prefill, sampled by vLLM's own sampler: plain's draw
    assert [t[0] for t in _tokens(dartree8["batches"][1])] == \
        [t[0] for t in _tokens(plain["batches"][2])]


@pytest.mark.parametrize("position", [1, 2])
def test_sampled_tokens_follow_the_target(plain, dartree8, position):
    """Tokens drawn by tree walks are distributed as plain sampling's (two-sample chi2)."""
    ours = [t[position] for t in _tokens(dartree8["batches"][1])]
    theirs = [t[position] for t in _tokens(plain["batches"][2])]
    common = sorted({*ours, *theirs}, key=lambda t: -(ours.count(t) + theirs.count(t)))
    keep = [t for t in common if ours.count(t) + theirs.count(t) >= 10]
    table = [[seq.count(t) for t in keep] + [sum(x not in keep for x in seq)]
             for seq in (ours, theirs)]
    table = [row for row in zip(*table) if sum(row)]
    assert len(table) >= 3, "too few distinct tokens for a distribution test"
    assert chi2_contingency(list(zip(*table))).pvalue > 1e-3


def test_sampled_walk_accepts_oracle_drafts_and_follows_the_target(tiny, plain, tmp_path):
    """T = 0.8 with a drafter that proposes the greedy continuation: the sampled walk
    accepts it where the target's draw agrees (accepted > 0 in vLLM's counters), and the
    tokens are still distributed as plain sampling's (two-sample chi2)."""
    table = [[SAMPLED_PROMPT, plain["batches"][5][0]["tokens"]]]
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"depth": ORACLE_DEPTH, "layer_ids": [1, 3],
                                  "continuations": table}))
    spec = dartree_spec(oracle, drafter_class=ORACLE, budget=2 * ORACLE_DEPTH,
                        adaptive=False)
    got = run_job(tmp_path, engine_kwargs(tiny["target"], max_num_seqs=16,
                                          speculative_config=spec), [_sampled_batch()])
    assert got["counters"]["vllm:spec_decode_num_accepted_tokens"] > 0
    for position in (1, 2):
        ours = [t[position] for t in _tokens(got["batches"][0])]
        theirs = [t[position] for t in _tokens(plain["batches"][2])]
        keep = [t for t in set(ours) | set(theirs) if ours.count(t) + theirs.count(t) >= 10]
        table = [[seq.count(t) for t in keep] + [sum(x not in keep for x in seq)]
                 for seq in (ours, theirs)]
        table = [row for row in zip(*table) if sum(row)]
        assert len(table) >= 3, "too few distinct tokens for a distribution test"
        assert chi2_contingency(list(zip(*table))).pvalue > 1e-3


def test_adaptive_budget_plain_steps_skip_the_drafter(plain, dartree8):
    """With the default adaptive budget and a drafter whose trees are never accepted (tiny
    random weights), most steps are plain and run no drafter pass at all; the output is
    still plain decoding's (test_dartree_greedy_equals_plain_batched), and the calibration
    predicts the (zero) acceptance it sees."""
    b = dartree8["budget"]
    assert b["steps"] > 0 and b["plain_steps"] > 0.5 * b["steps"]
    # tree steps with lookup nodes alone run no drafter pass either
    assert b["draft_passes"] <= b["tree_steps"] < b["steps"]
    drafter_only = b["observed_accepted"] - b["lookup_accepted"] - b["shared_accepted"]
    assert b["rounds"] > 0 and drafter_only <= b["rounds"] * 0.2
    assert b["live_requests"] == 0, "per-request budget state outlived its requests"


def test_confidence_planning_stays_exact(tiny, plain, prompts, tmp_path):
    """The opt-in confidence factor (`VLLM_DARTREE_CONFIDENCE=1`) changes only which trees
    are verified: greedy output is plain decoding's, and the trace shows the walks booked to
    the confidence bins the sampler measured."""
    from vllm_dartree.engine.trace import by_confidence, read_trace
    trace = tmp_path / "trace.jsonl"
    n = 8
    got = run_job(tmp_path, engine_kwargs(tiny["target"], max_num_seqs=4,
                                          speculative_config=dartree_spec(tiny["drafter"])),
                  [{"prompts": prompts[:n], "params": _greedy(prompts)[:n]}],
                  env={"VLLM_DARTREE_CONFIDENCE": "1", "VLLM_DARTREE_TRACE": str(trace)})
    _assert_same(_tokens(got["batches"][0]), _tokens(plain["batches"][0][:n]), "confidence")
    conf = by_confidence(read_trace(trace))
    assert sum(r["trees"] for r in conf) > 0


def _repeats(prompt, output, n=3):
    """Output tokens that continue an n-gram seen before in prompt + output."""
    seq, seen, hits = list(prompt) + list(output), set(), 0
    for e in range(n, len(seq)):
        key = tuple(seq[e - n:e])
        if e >= len(prompt) and key in seen:
            hits += 1
        seen.add(key)
    return hits


def test_lookup_branches_are_accepted_where_the_target_repeats(plain, dartree8, prompts):
    """The tiny random target loops in greedy decoding, so continuations of its own output
    found by lookup are right: lookup nodes (not the drafter's) are accepted, vLLM counts
    accepted drafts, and the output is still plain decoding's (the batched greedy test)."""
    outs = _tokens(plain["batches"][0])
    assert sum(_repeats(p, o) for p, o in zip(prompts, outs)) >= 20, "premise: loops"
    b = dartree8["budget"]
    assert b["lookup_nodes"] > 0 and b["lookup_accepted"] > 0
    # indices follow their requests incrementally (rebuilt only after a preemption) and are
    # freed with them
    assert b["lookup_rebuilds"] <= dartree8["counters"].get("vllm:num_preemptions", 0)
    assert b["lookup_live_requests"] == 0
    assert dartree8["counters"]["vllm:spec_decode_num_accepted_tokens"] >= b["lookup_accepted"]


def test_the_cpu_tree_kernel_is_resolved_when_the_engine_starts(tiny, tmp_path):
    """The worker builds (or loads) the compiled CPU tree attention while the engine starts,
    before any request: its first build on a machine takes about a minute, which the first
    request would otherwise wait out mid-answer. Off (`VLLM_DARTREE_CPU_KERNEL=0`), it is
    left alone."""
    engine = engine_kwargs(tiny["target"], speculative_config=dartree_spec(tiny["drafter"]))
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    got = run_job(tmp_path, engine, [], env=env, kernel_state=True)
    assert got["kernel_resolved"] == [True]
    got = run_job(tmp_path, engine, [], env={**env, "VLLM_DARTREE_CPU_KERNEL": "0"},
                  kernel_state=True)
    assert got["kernel_resolved"] == [False]
