"""Engine pieces without an engine: config translation and start-up refusals, the CPU
tree-attention backend against the paged reference, KV writes and compaction, tree metrics."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.conftest import dartree_spec
from vllm_dartree.attention import PagedBatch, paged_attention_reference
from vllm_dartree.engine import attention as token_layout
from vllm_dartree.engine import cpu_attention, cpu_kernel
from vllm_dartree.engine.cpu_attention import (
    DARTreeCPUAttentionImpl,
    DARTreeCPUMetadata,
    copy_slots,
    kv_views,
    vec_views,
    write_slots,
)
from vllm_dartree.engine.metrics import DARTreeStatLogger, TreeStats
from vllm_dartree.engine.plugin import PROPOSER, DartreeConfigError, translate
from vllm_dartree.tree.structure import ancestor_mask, mask_to_bitmask


# -- config translation ------------------------------------------------------------------
def test_translate_builds_the_carrier(tiny):
    carrier, settings = translate(dartree_spec(tiny["drafter"], variant="fixed"))
    assert carrier == {"method": "custom_class", "model": PROPOSER,
                       "num_speculative_tokens": 16}
    assert settings.config.variant == "fixed" and settings.config.width == 4
    assert settings.drafter == str(tiny["drafter"].resolve())


@pytest.mark.parametrize("change, message", [
    ({"budget": 0}, "budget"),
    ({"budget": 200}, "at most 128 draft tokens"),
    ({"depth_bonus": 0.3}, "depth_bonus"),
    ({"variant": "wide"}, "variant"),
    ({"widht": 3}, "unknown dartree speculative_config key(s) ['widht']"),
    ({"num_speculative_tokens": 7}, "num_speculative_tokens = 7 must equal"),
    ({"model": "/nowhere/drafter"}, "does not exist"),
    ({"model": None}, "must name the drafter"),
])
def test_translate_refuses_bad_configs(tiny, change, message):
    with pytest.raises(DartreeConfigError, match=None) as err:
        translate({**dartree_spec(tiny["drafter"]), **change})
    assert message in str(err.value)


def test_engine_args_translation(tiny):
    """EngineArgs (as LLM(...) and `vllm serve` build them) -> a VllmConfig in carrier form."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny["target"]), dtype="float32", max_model_len=256,
                      enable_prefix_caching=True,
                      speculative_config=dartree_spec(tiny["drafter"]))
    config = args.create_engine_config()
    assert config.speculative_config.method == "custom_class"
    assert config.speculative_config.num_speculative_tokens == 16
    assert config.parallel_config.worker_cls.endswith("DARTreeCPUWorker")
    assert config.cache_config.enable_prefix_caching is False
    assert config.additional_config["dartree"]["config"]["width"] == 4


@pytest.mark.parametrize("kwargs,message", [
    (dict(kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}),
     "kv_transfer_config"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="mp"),
     "pipeline parallelism is not supported"),
])
def test_engine_args_refuse_what_corrupts_the_kv_layout(tiny, kwargs, message):
    """Refused before any engine process starts, with the reason (they once failed late
    inside the worker)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny["target"]), dtype="float32", max_model_len=256,
                      speculative_config=dartree_spec(tiny["drafter"]), **kwargs)
    with pytest.raises(DartreeConfigError, match=message):
        args.create_engine_config()


def test_engine_args_refuse_a_misfit_drafter(tiny, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dartree.testing import write_tiny_drafter, write_tiny_target
    other = write_tiny_target(tmp_path / "other", hidden=96, head_dim=32)
    drafter = write_tiny_drafter(tmp_path / "drafter", "domino", other)
    args = EngineArgs(model=str(tiny["target"]), dtype="float32", max_model_len=256,
                      speculative_config=dartree_spec(drafter))
    with pytest.raises(DartreeConfigError, match="hidden_size = 96 does not match"):
        args.create_engine_config()


# -- CPU attention -------------------------------------------------------------------------
def _random_tree(n, gen):
    parents = [-1]
    for i in range(1, n):
        parents.append(int(torch.randint(-1, i, (1,), generator=gen)))
    return torch.tensor(parents)


@pytest.fixture(params=["sdpa", "kernel"])
def attention_path(request, monkeypatch):
    """The CPU backend's torch (SDPA) path, or the compiled kernel for every request it can
    take (rows <= 80 instead of the defaults, so trees go through it too)."""
    if request.param == "sdpa":
        monkeypatch.setattr(cpu_kernel, "load", lambda: None)
    else:
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler: the kernel cannot be built here")
        assert cpu_kernel.load() is not None, "a compiler is here, yet the kernel did not build"
        monkeypatch.setattr(cpu_attention, "KERNEL_MAX_ROWS", 80)
        monkeypatch.setattr(cpu_attention, "VEC_KERNEL_MAX_ROWS", 80)
        monkeypatch.setattr(cpu_attention, "VEC_KERNEL_MAX_ROWS_AVX512", 80)
    return request.param


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_big_trees_go_to_the_kernel_where_it_is_built_for_avx512(isa, monkeypatch):
    """On the vec layout a tree of 65 rows (64 nodes and the root) is attended by the compiled
    kernel when it was built for AVX-512 (ahead of SDPA past 65 rows), and so is a decode
    row in the same step (ahead of vLLM's kernel, and one call instead of two); a prompt
    chunk longer than any tree stays with vLLM's kernel. On an AVX2 build: the tree to SDPA,
    the decode row and the chunk to vLLM's kernel."""
    monkeypatch.setattr(cpu_kernel, "isa", lambda: isa)
    q_len, chunk, seq_len, bs = 65, 100, 200, 32
    rows = [1, q_len, chunk]
    md = DARTreeCPUMetadata(num_actual_tokens=sum(rows), max_query_len=chunk,
                            query_start_loc=torch.tensor([0, 1, 1 + q_len, sum(rows)],
                                                         dtype=torch.int32),
                            max_seq_len=seq_len,
                            seq_lens=torch.tensor([seq_len] * 3, dtype=torch.int32),
                            block_table=torch.arange(21, dtype=torch.int32).reshape(3, 7),
                            slot_mapping=torch.zeros(sum(rows), dtype=torch.long))
    md.attach_trees([False, True, False], torch.zeros(3, chunk, 4, dtype=torch.int32))
    plan = cpu_attention._plan(md, bs, True, "vec")
    if isa == "avx512":
        assert plan.kernel.tolist() == [0, 1] and not plan.batched
        assert plan.vllm.rows.tolist() == list(range(1 + q_len, sum(rows)))   # the chunk
    else:
        assert plan.kernel is None and plan.batched == [1]
        assert plan.vllm.rows.tolist() == [0, *range(1 + q_len, sum(rows))]


@pytest.fixture(params=["token", "vec"])
def kv_layout(request, monkeypatch):
    """The CPU backend's two KV layouts (`cpu_attention.kv_layout`): vec, vLLM's own (its
    kernel attends the requests without a tree), where this machine's vLLM build has it."""
    monkeypatch.setenv(cpu_attention.LAYOUT_ENV, request.param)
    if request.param == "vec" and cpu_attention.kv_layout(torch.zeros(1, 1, 32, 64)) != "vec":
        pytest.skip("vLLM's vec CPU attention is not available on this machine")
    return request.param


def _paged_kv(k_rows: torch.Tensor, v_rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """A KV tensor in the current layout holding K/V rows [slots, KVH, D] at slots 0.."""
    n, kvh, d = k_rows.shape
    kv = torch.zeros(n // block_size, kvh, block_size, 2 * d, dtype=k_rows.dtype)
    cpu_attention.write_slots(kv, k_rows, v_rows, torch.arange(n))
    return kv


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("chunk", [20, 90])   # a prompt chunk in the padded batch or alone
def test_tree_attention_equals_paged_reference(group, chunk, attention_path, kv_layout):
    """Mixed batch (decode row, prefill chunk, tree) over a paged cache, GQA or not, either
    KV layout (on vec, the decode row and the chunk go to vLLM's own kernel)."""
    gen = torch.Generator().manual_seed(0)
    kvh, d, bs, nb = 2, 32, 32, 12
    nh = kvh * group
    token_kv = torch.randn(nb, kvh, bs, 2 * d, generator=gen)
    k_cache, v_cache = kv_views(token_kv, d)
    kv = _paged_kv(k_cache.reshape(-1, kvh, d), v_cache.reshape(-1, kvh, d), bs)
    assert cpu_attention.kv_layout(kv) == kv_layout
    q_lens, seq_lens = [1, chunk, 9], [40, 95, 50]
    parents = _random_tree(8, gen)
    mask = ancestor_mask(parents[None])[0]                                 # [9, 9]
    qmax = max(q_lens)
    bits = torch.zeros(3, qmax, 1, dtype=torch.int32)
    bits[2, :9] = mask_to_bitmask(mask[None])[0]
    table = torch.randperm(nb, generator=gen)[:9].reshape(3, 3).int()
    t = sum(q_lens)
    qsl = torch.tensor([0, 1, 1 + chunk, t], dtype=torch.int32)
    q = torch.randn(t, nh, d, generator=gen)
    md = DARTreeCPUMetadata(num_actual_tokens=t, max_query_len=qmax, query_start_loc=qsl,
                            max_seq_len=95, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                            block_table=table, slot_mapping=torch.zeros(t, dtype=torch.long),
                            is_tree=[False, False, True], tree_mask=bits)
    impl = DARTreeCPUAttentionImpl(nh, d, 0.3, kvh, None, None, "auto")
    out = torch.zeros(t, nh * d)
    impl.forward(None, q.reshape(t, -1), None, None, kv, md, out)
    batch = PagedBatch(qsl.long(), torch.tensor(seq_lens), table.long(),
                       torch.tensor([False, False, True]), bits)
    want = paged_attention_reference(q, k_cache.contiguous(), v_cache.contiguous(), batch, 0.3)
    torch.testing.assert_close(out.reshape(t, nh, d), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_steps_without_trees_as_vllm_passes_them(group, kv_layout):
    """What vLLM's Attention layer hands the impl (3-D views of a fused QKV projection, K/V
    rows strided) on a step without trees (decode rows and a prompt chunk): on the vec
    layout the impl's direct path to vLLM's ops; the KV writes and the attention equal the
    paged reference and the general path's."""
    gen = torch.Generator().manual_seed(1)
    kvh, d, bs, nb = 2, 32, 32, 12
    nh = kvh * group
    q_lens, seq_lens = [1, 30, 1], [40, 95, 64]
    t = sum(q_lens)
    table = torch.randperm(nb, generator=gen)[:9].reshape(3, 3).int()
    # history: every slot below each request's new rows, written through the general path
    kv = torch.zeros(nb, kvh, bs, 2 * d)
    k_all, v_all = torch.randn(nb * bs, kvh, d, generator=gen), torch.randn(nb * bs, kvh, d,
                                                                            generator=gen)
    def slot(r, pos):
        return int(table[r, pos // bs]) * bs + pos % bs
    old = torch.tensor([slot(r, p) for r in range(3) for p in range(seq_lens[r] - q_lens[r])])
    cpu_attention.write_slots(kv, k_all[old], v_all[old], old)
    new = torch.tensor([slot(r, p) for r in range(3)
                        for p in range(seq_lens[r] - q_lens[r], seq_lens[r])])
    qkv = torch.randn(t, (nh + 2 * kvh) * d, generator=gen)     # the layer's fused output
    q = qkv[:, :nh * d].view(t, nh, d)
    key = qkv[:, nh * d:(nh + kvh) * d].view(t, kvh, d)
    value = qkv[:, (nh + kvh) * d:].view(t, kvh, d)
    impl = DARTreeCPUAttentionImpl(nh, d, 0.3, kvh, None, None, "auto")
    impl.do_kv_cache_update(None, key, value, kv, new)
    qsl = torch.tensor([0, 1, 31, 32], dtype=torch.int32)
    md = DARTreeCPUMetadata(num_actual_tokens=t, max_query_len=30, query_start_loc=qsl,
                            max_seq_len=95, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                            block_table=table, slot_mapping=new)
    out = torch.zeros(t, nh, d)
    impl.forward(None, q, key, value, kv, md, out)
    k_ref, v_ref = k_all.clone(), v_all.clone()
    k_ref[new], v_ref[new] = key, value
    k_cache = k_ref.view(nb, bs, kvh, d)
    v_cache = v_ref.view(nb, bs, kvh, d)
    batch = PagedBatch(qsl.long(), torch.tensor(seq_lens), table.long(),
                       torch.tensor([False, False, False]),
                       torch.zeros(3, 30, 1, dtype=torch.int32))
    want = paged_attention_reference(q, k_cache, v_cache, batch, 0.3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    general = torch.zeros(t, nh, d)
    cpu_attention.tree_attention(q.contiguous(), kv, md, 0.3, general)
    torch.testing.assert_close(out, general, atol=1e-6, rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), requests=st.integers(1, 5), group=st.sampled_from([1, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), d=st.sampled_from([16, 64]))
def test_cpu_kernel_equals_the_sdpa_path(seed, requests, group, dtype, d):
    """The compiled kernel against the SDPA path on random batches: decode rows, causal
    chunks and trees of random shapes, random paged tables, GQA groups, fp32 and bf16, a
    head size with the kernel's compile-time path (64) and one without (16)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    module = cpu_kernel.load()
    assert module is not None
    gen = torch.Generator().manual_seed(seed)
    kvh, bs = 2, 8
    nh = kvh * group
    q_lens = [int(torch.randint(1, 12, (1,), generator=gen)) for _ in range(requests)]
    seq_lens = [q + int(torch.randint(0, 30, (1,), generator=gen)) for q in q_lens]
    trees = [bool(torch.rand(1, generator=gen) < 0.5) for _ in range(requests)]
    per = -(-max(seq_lens) // bs)
    nb = requests * per + 3
    kv = torch.randn(nb, kvh, bs, 2 * d, generator=gen).to(dtype)
    table = torch.randperm(nb, generator=gen)[:requests * per].reshape(requests, per).int()
    qmax = max(q_lens)
    bits = torch.zeros(requests, qmax, 1, dtype=torch.int32)
    for r, q in enumerate(q_lens):
        if trees[r]:
            bits[r, :q] = mask_to_bitmask(ancestor_mask(_random_tree(q - 1, gen)[None])
                                          if q > 1 else torch.ones(1, 1, 1, dtype=torch.bool))[0]
    t = sum(q_lens)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(t, nh, d, generator=gen).to(dtype)
    outs = []
    for use in (False, True):
        md = DARTreeCPUMetadata(num_actual_tokens=t, max_query_len=qmax, query_start_loc=qsl,
                                max_seq_len=max(seq_lens),
                                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                block_table=table, slot_mapping=torch.zeros(t, dtype=torch.long),
                                is_tree=trees if any(trees) else None,
                                tree_mask=bits if any(trees) else None)
        out = torch.full((t, nh, d), float("nan"), dtype=dtype)
        if use:   # every request through the kernel
            module.tree_attention(q, kv, table, qsl, md.seq_lens,
                                  torch.arange(requests, dtype=torch.int64),
                                  torch.tensor(trees, dtype=torch.uint8), bits, 0.25, 4, False,
                                  out)
        else:
            cpu_attention.tree_attention(q, kv, md, 0.25, out, kernel=False)
        outs.append(out.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), requests=st.integers(1, 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), d=st.sampled_from([32, 64]),
       kernel=st.sampled_from([None, False]))
def test_vec_layout_equals_the_token_layout(seed, requests, dtype, d, kernel):
    """The same K/V written in both CPU layouts, the same random batch (decode rows, causal
    chunks across blocks, trees of up to 89 rows, GQA): on vec, vLLM's kernel takes the
    requests without a tree (on an AVX-512 build only those longer than any tree, in steps
    with trees) and dartree's kernel (or, kernel=False, SDPA over the gathered blocks) the
    rest; the result equals the token layout's SDPA path."""
    gen = torch.Generator().manual_seed(seed)
    vec_kv = torch.zeros(1, 1, 32, 2 * d, dtype=dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu_attention.LAYOUT_ENV, "vec")
        if cpu_attention.kv_layout(vec_kv) != "vec":
            pytest.skip("vLLM's vec CPU attention is not available on this machine")
    if kernel is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    kvh, group, bs = 2, 3, 32
    q_lens = [int(torch.randint(1, 90 if torch.rand(1, generator=gen) < 0.3 else 10, (1,),
                                generator=gen)) for _ in range(requests)]
    seq_lens = [q + int(torch.randint(0, 100, (1,), generator=gen)) for q in q_lens]
    trees = [bool(torch.rand(1, generator=gen) < 0.5) for _ in range(requests)]
    per = -(-max(seq_lens) // bs)
    nb = requests * per + 2
    table = torch.randperm(nb, generator=gen)[:requests * per].reshape(requests, per).int()
    qmax = max(q_lens)
    bits = torch.zeros(requests, qmax, -(-qmax // 32), dtype=torch.int32)
    for r, q in enumerate(q_lens):
        if trees[r]:   # a tree narrower than the widest request fills its first words
            own = mask_to_bitmask(ancestor_mask(_random_tree(q - 1, gen)[None])
                                  if q > 1 else torch.ones(1, 1, 1, dtype=torch.bool))[0]
            bits[r, :q, :own.shape[-1]] = own
    k_rows = torch.randn(nb * bs, kvh, d, generator=gen).to(dtype)
    v_rows = torch.randn(nb * bs, kvh, d, generator=gen).to(dtype)
    t = sum(q_lens)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(t, kvh * group, d, generator=gen).to(dtype)
    outs = []
    for layout in ("token", "vec"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu_attention.LAYOUT_ENV, layout)
            kv = _paged_kv(k_rows, v_rows, bs)
            md = DARTreeCPUMetadata(num_actual_tokens=t, max_query_len=qmax,
                                    query_start_loc=qsl, max_seq_len=max(seq_lens),
                                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                    block_table=table,
                                    slot_mapping=torch.zeros(t, dtype=torch.long))
            md.attach_trees(trees if any(trees) else None, bits if any(trees) else None)
            out = torch.full((t, kvh * group, d), float("nan"), dtype=dtype)
            cpu_attention.tree_attention(q, kv, md, 0.2, out,
                                         kernel=False if layout == "token" else kernel)
            outs.append(out.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


def test_cpu_kernel_writes_slots_like_torch():
    """The kernel's KV write against the torch one: padding slots (-1) skipped, strided
    key / value rows (views of a fused projection), fp32 and bf16."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    module = cpu_kernel.load()
    assert module is not None
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(6, 2, 4, 2 * 8, generator=gen).to(dtype)
        fused = torch.randn(7, 3 * 2 * 8, generator=gen).to(dtype)
        key = fused[:, :16].view(7, 2, 8)
        value = fused[:, 16:32].view(7, 2, 8)
        slots = torch.tensor([3, -1, 0, 23, 9, -1, 14])
        want = kv.clone()
        token_layout.write_slots(want, key, value, slots)
        module.write_slots(kv, key, value, slots)
        assert torch.equal(kv, want)


def _read_slot(kv: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [KVH, D] of one slot, read the way the tensor's layout stores them."""
    bs, d = kv.shape[2], kv.shape[3] // 2
    if cpu_attention.kv_layout(kv) == "vec":
        k_t, v = vec_views(kv)
        return k_t[slot // bs, :, :, slot % bs], v[slot // bs, :, slot % bs]
    k_cache, v_cache = kv_views(kv, d)
    return k_cache[slot // bs, slot % bs], v_cache[slot // bs, slot % bs]


def test_kv_write_and_compaction(kv_layout):
    kvh, d, bs, nb = 2, 32, 32, 4
    kv = torch.zeros(nb, kvh, bs, 2 * d)
    impl = DARTreeCPUAttentionImpl(4, d, 1.0, kvh, None, None, "auto")
    key, value = torch.randn(5, kvh * d), torch.randn(5, kvh * d)
    slots = torch.tensor([3, 40, 41, -1, 127])
    impl.do_kv_cache_update(None, key, value, kv, slots)
    assert int((kv != 0).sum()) == 4 * kvh * 2 * d          # the padding row wrote nothing
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k, v = _read_slot(kv, slot)
            assert torch.equal(k, key[row].view(kvh, d))
            assert torch.equal(v, value[row].view(kvh, d))
    before = kv.clone()
    copy_slots(kv, torch.tensor([41, 127]), torch.tensor([40, 41]))   # overlapping move
    assert all(torch.equal(a, b) for a, b in zip(_read_slot(kv, 40), _read_slot(before, 41)))
    assert all(torch.equal(a, b) for a, b in zip(_read_slot(kv, 41), _read_slot(before, 127)))
    for slot in (3, 127):                                          # the others untouched
        assert all(torch.equal(a, b) for a, b in zip(_read_slot(kv, slot),
                                                       _read_slot(before, slot)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(sliding_window=128), "sliding-window"),
    (dict(alibi_slopes=[1.0]), "ALiBi"),
    (dict(logits_soft_cap=30.0), "softcapping"),
    (dict(kv_cache_dtype="fp8"), "fp8"),
])
def test_attention_refuses_what_it_cannot_do(kwargs, message):
    base = dict(num_heads=4, head_size=32, scale=1.0, num_kv_heads=2, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto")
    with pytest.raises(NotImplementedError, match=message):
        DARTreeCPUAttentionImpl(**{**base, **kwargs})


# -- metrics -------------------------------------------------------------------------------
def test_tree_stats_histogram_from_vllm_counters():
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    spec = SpecDecodingStats.new(16)
    rounds = [(16, 3), (12, 0), (16, 5), (9, 3)]
    for nodes, accepted in rounds:
        spec.observe_draft(nodes, accepted)
    stats = TreeStats()
    stats.add(spec)
    assert stats.rounds == 4 and stats.nodes == 53
    assert stats.depths == [1, 0, 0, 2, 0, 1]
    assert "13.2 nodes/round" in stats.line() and "tau 3.75" in stats.line()


def test_stat_logger_is_inactive_without_dartree():
    class Cfg:
        additional_config = {}
    assert not DARTreeStatLogger(Cfg()).active


@pytest.mark.parametrize("kwargs,fields", [
    (dict(temperature=0.0), []),
    (dict(temperature=0.7, top_p=0.9, top_k=5, seed=3, n=2, stop=["x"], max_tokens=4,
          stop_token_ids=[3], ignore_eos=True, prompt_logprobs=1, skip_special_tokens=False), []),
    (dict(min_tokens=3, ignore_eos=True), []),        # no stop token left to suppress
    (dict(min_tokens=3, stop_token_ids=[7]), ["min_tokens"]),
    (dict(logprobs=2), ["logprobs"]),
    (dict(logprob_token_ids=[1, 2]), ["logprob_token_ids"]),
    (dict(repetition_penalty=1.2, presence_penalty=0.5), ["presence_penalty",
                                                         "repetition_penalty"]),
    (dict(frequency_penalty=0.5), ["frequency_penalty"]),
    (dict(bad_words=["hi"]), ["bad_words"]),
    (dict(allowed_token_ids=[1, 2]), ["allowed_token_ids"]),
    (dict(extra_args={"custom": 1}), ["extra_args"]),
    (dict(thinking_token_budget=10), ["thinking_token_budget"]),
])
def test_full_sampler_fields_is_an_allow_list(kwargs, fields):
    from vllm import SamplingParams

    from vllm_dartree.engine.tree_sampler import full_sampler_fields
    assert sorted(full_sampler_fields(SamplingParams(**kwargs))) == sorted(fields)


def test_a_field_vllm_adds_later_takes_vllms_sampler():
    from vllm import SamplingParams

    from vllm_dartree.engine.tree_sampler import full_sampler_fields

    class Later(SamplingParams, kw_only=True):
        later_feature: int | None = None

    assert full_sampler_fields(Later()) == []
    assert full_sampler_fields(Later(later_feature=3)) == ["later_feature"]


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("setting,device,flags,want", [
    ("auto", "cpu", {"avx512f", "amx_bf16", "amx_tile"}, (BF16, F32)),
    ("auto", "cpu", {"avx2", "fma"}, (F32, F32)),        # no AMX: bf16 would be slower
    ("auto", "cuda", {"amx_bf16", "amx_tile"}, (F32, F32)),
    ("model", "cpu", {"amx_bf16", "amx_tile"}, (F32, F32)),
    ("float32", "cpu", {"amx_bf16", "amx_tile"}, (F32, F32)),
    ("bfloat16", "cpu", set(), (BF16, BF16))])
def test_drafter_dtype_follows_the_setting_and_the_cpu(setting, device, flags, want):
    """`drafter_dtype` -> (backbone, head): `auto` puts the backbone in bfloat16 only on a
    CPU with AMX and keeps the head in the target's dtype; `model` and explicit dtypes are
    both's."""
    from vllm_dartree.engine.proposer import drafter_dtype
    assert drafter_dtype(setting, torch.float32, device, cpu_flags=flags) == want


def _tiny_drafter_in(tiny, seed: int, dtype, head_dtype=None):
    """(the tiny target's config, a generator, its drafter in `dtype` / `head_dtype`) with
    random target embedding and lm-head weights."""
    from vllm_dartree.drafter import TargetInfo, load_drafter
    from transformers import AutoConfig
    text = AutoConfig.from_pretrained(tiny["target"])
    info = TargetInfo(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                      num_hidden_layers=text.num_hidden_layers)
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(text.vocab_size, text.hidden_size, generator=gen)
    head = torch.randn(text.vocab_size, text.hidden_size, generator=gen)
    return text, gen, load_drafter(tiny["drafter"], info, embed, head, dtype=dtype,
                                   head_dtype=head_dtype)


def test_a_bf16_drafter_casts_the_targets_head_once(tiny):
    """A drafter in bfloat16 beside an fp32 target: its output projection (the target's
    lm_head, or its draft-vocabulary rows) is cast once and reused, and its logits equal
    those of the fp32 head cast by hand."""
    from vllm_dartree.drafter import ContextCache
    text, gen, drafter = _tiny_drafter_in(tiny, 0, torch.bfloat16)
    backbone = drafter.backbone
    assert backbone.fc.weight.dtype == torch.bfloat16 and backbone.output_weight.dtype == torch.float32
    first = backbone._output_weight_as(torch.bfloat16)
    assert first is backbone._output_weight_as(torch.bfloat16)       # cast once
    assert torch.equal(first, backbone.output_weight.to(torch.bfloat16))
    cache = ContextCache()
    width = len(drafter.spec.target_layer_ids) * text.hidden_size
    backbone.extend_context(cache, ["r"], [torch.randn(5, width, generator=gen)])
    out = backbone(cache, ["r"], torch.tensor([3]), num_depths=2)
    assert out.base_logits.dtype == torch.bfloat16
    want = out.hidden.float() @ backbone.output_weight.to(torch.bfloat16).float().T
    torch.testing.assert_close(out.base_logits.float(), want, atol=0.1, rtol=0.02)


def test_a_bf16_backbone_feeds_an_fp32_head(tiny):
    """`drafter_dtype: auto` on AMX: the backbone in bfloat16, the correction head in fp32.
    The engine's drafter then builds exactly the tree that an fp32 head builds from the
    bf16 backbone's outputs cast up by hand (the head sees no bf16 rounding of its own)."""
    from vllm_dartree.config import DARTreeConfig
    from vllm_dartree.engine.drafters import CheckpointTreeDrafter
    text, gen, mixed = _tiny_drafter_in(tiny, 1, torch.bfloat16, head_dtype=torch.float32)
    assert mixed.backbone.fc.weight.dtype == torch.bfloat16
    assert {p.dtype for p in mixed.head.parameters()} == {torch.float32}
    engine = CheckpointTreeDrafter(DARTreeConfig(budget=12), mixed, cuda_graphs=False)
    width = len(mixed.spec.target_layer_ids) * text.hidden_size
    rids, roots = ["a", "b"], torch.tensor([3, 7])
    engine.extend(rids, [[1] * 6, [2] * 4],
                  [torch.randn(6, width, generator=gen), torch.randn(4, width, generator=gen)])
    got = engine.draft(rids, roots, num_depths=3)
    out = mixed.backbone(engine.cache, rids, roots, num_depths=3)
    assert out.hidden.dtype == torch.bfloat16
    want = engine.builder(out.base_logits.float(), out.hidden.float(), roots)[0]
    assert int(got.num_nodes.sum()) > 2
    for name in ("tokens", "parents", "depths", "num_nodes"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.scores, want.scores)


@settings(max_examples=60, deadline=None)
@given(parents=st.lists(st.integers(-1, 30), min_size=1, max_size=12))
def test_a_chain_tree_is_verified_as_causal_rows(parents):
    """`is_chain`: exactly the trees whose ancestor mask is the causal triangle (and whose
    positions p0 + depth are a chain's slots p0 + 1 .. p0 + n), which the runner then
    verifies as causal rows through vLLM's own attention."""
    from vllm_dartree.engine.tree_inputs import is_chain
    n = len(parents)
    tree = torch.tensor([min(p, j - 1) for j, p in enumerate(parents)])   # parent < node
    mask = ancestor_mask(tree[None])[0]
    causal = torch.ones(1 + n, 1 + n, dtype=torch.bool).tril()
    assert is_chain(tree) == torch.equal(mask, causal)
    assert is_chain(torch.arange(-1, n - 1))
    depths = torch.zeros(n, dtype=torch.long)
    for j, p in enumerate(tree.tolist()):
        depths[j] = 1 + (int(depths[p]) if p >= 0 else 0)
    if is_chain(tree):
        assert depths.tolist() == list(range(1, n + 1))
