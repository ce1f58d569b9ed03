"""The GPU path's engine pieces, on CPU: the Triton backend's metadata builder and impl
against the CPU backend on the same scheduled batch, the runner's batched tree inputs
against a per-request oracle, and the plugin's CUDA selection (worker + CUSTOM backend)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from tests.engine.conftest import dartree_spec
from tests.helpers import random_parents
from vllm_dartree.engine.attention import kv_views
from vllm_dartree.engine.cpu_attention import DARTreeCPUAttentionImpl, DARTreeCPUMetadataBuilder
from vllm_dartree.engine.gpu_attention import (
    DARTreeGPUAttentionBackend,
    DARTreeGPUAttentionImpl,
    DARTreeGPUMetadataBuilder,
)
from vllm_dartree.engine.runner import tree_rows
from vllm_dartree.tree import ancestor_mask, bitmask_to_mask


def _tree(n, seed):
    parents = random_parents(1, n, torch.Generator().manual_seed(seed))[0]
    depths = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        depths[i] = 1 if p < 0 else depths[p] + 1
    return parents, depths


def _scheduled_batch(seed=0):
    """Four requests: decode row, tree of 9 nodes, prompt chunk of 20, tree of 33 nodes."""
    trees = [None, _tree(9, seed + 1), None, _tree(33, seed + 2)]
    rows = np.array([1, 10, 20, 34])
    p0 = np.array([39, 12, 0, 70])                   # position of each request's first row
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
    return trees, rows, p0, starts


def test_tree_rows_match_a_per_request_oracle():
    trees, rows, p0, starts = _scheduled_batch()
    mask, index, positions = tree_rows(trees, starts, rows, p0, "cpu")
    flat = torch.as_tensor(np.concatenate([p + np.arange(n) for p, n in zip(p0, rows)]))
    flat.index_copy_(0, index, positions)
    q_max = int(rows.max())
    assert mask.shape == (4, q_max, (q_max + 31) // 32) and mask.dtype == torch.int32
    for i, tree in enumerate(trees):
        lo, n = int(starts[i]), int(rows[i])
        if tree is None:
            assert torch.equal(flat[lo:lo + n], torch.arange(n) + int(p0[i]))   # untouched
            assert not mask[i].any()
            continue
        parents, depths = tree
        assert flat[lo] == p0[i]                                              # the root
        assert torch.equal(flat[lo + 1:lo + n], int(p0[i]) + depths)
        want = ancestor_mask(parents[None])[0]                                # [n, n]
        assert torch.equal(bitmask_to_mask(mask[i, :n], n), want)
        assert not mask[i, n:].any()


def test_tree_rows_without_trees_is_none():
    assert tree_rows([None, None], np.array([0, 1]), np.array([1, 1]), np.array([4, 5]),
                     "cpu") is None


def _common(trees, rows, p0, block_size, num_blocks, gen):
    seq_lens = torch.as_tensor(p0 + rows, dtype=torch.int32)
    per_req = (seq_lens + block_size - 1) // block_size
    table = torch.zeros(len(rows), int(per_req.max()), dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    used = 0
    for r, nb in enumerate(per_req.tolist()):
        table[r, :nb] = perm[used:used + nb]
        used += nb
    qsl = torch.as_tensor(np.concatenate([[0], np.cumsum(rows)]), dtype=torch.int32)
    t = int(rows.sum())
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=len(rows),
        num_actual_tokens=t, max_query_len=int(rows.max()), max_seq_len=int(seq_lens.max()),
        block_table_tensor=table, slot_mapping=torch.zeros(t, dtype=torch.long))


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_gpu_backend_equals_cpu_backend_on_one_scheduled_batch(kernel, monkeypatch):
    """Same CommonAttentionMetadata, same trees, same KV tensor: the GPU builder + impl
    (torch reference, or the Triton kernel under TRITON_INTERPRET=1) give the CPU
    backend's output on every row."""
    gen = torch.Generator().manual_seed(3)
    trees, rows, p0, starts = _scheduled_batch(seed=3)
    kvh, group, d, bs, nb = 2, 2, 32, 16, 24
    nh = kvh * group
    cm = _common(trees, rows, p0, bs, nb, gen)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    gpu_md = DARTreeGPUMetadataBuilder(None, [], config, torch.device("cpu")).build(0, cm)
    cpu_md = DARTreeCPUMetadataBuilder(None, [], config, torch.device("cpu")).build(0, cm)
    mask, _, _ = tree_rows(trees, starts, rows, p0, "cpu")
    is_tree = [t is not None for t in trees]
    gpu_md.attach_trees(is_tree, mask)
    cpu_md.attach_trees(is_tree, mask)
    assert gpu_md.is_tree.tolist() == [0, 1, 0, 1]
    kv = torch.randn(nb, kvh, bs, 2 * d, generator=gen)
    t = int(rows.sum())
    q = torch.randn(t, nh * d, generator=gen)
    if kernel == "triton":
        monkeypatch.setattr("vllm_dartree.ops.use_triton", lambda tensor: True)
    gpu_out, cpu_out = torch.zeros(t, nh * d), torch.zeros(t, nh * d)
    DARTreeGPUAttentionImpl(nh, d, 0.2, kvh, None, None, "auto").forward(
        None, q, None, None, kv, gpu_md, gpu_out)
    DARTreeCPUAttentionImpl(nh, d, 0.2, kvh, None, None, "auto").forward(
        None, q, None, None, kv, cpu_md, cpu_out)
    torch.testing.assert_close(gpu_out, cpu_out, atol=2e-5, rtol=2e-5)
    # a causal step (no trees attached): the persistent all-causal inputs
    causal_md = DARTreeGPUMetadataBuilder(None, [], config, torch.device("cpu")).build(0, cm)
    causal_md.attach_trees(None, None)
    cpu_md.attach_trees(None, None)
    DARTreeGPUAttentionImpl(nh, d, 0.2, kvh, None, None, "auto").forward(
        None, q, None, None, kv, causal_md, gpu_out)
    DARTreeCPUAttentionImpl(nh, d, 0.2, kvh, None, None, "auto").forward(
        None, q, None, None, kv, cpu_md, cpu_out)
    torch.testing.assert_close(gpu_out, cpu_out, atol=2e-5, rtol=2e-5)


def test_gpu_kv_write_lands_where_the_cpu_backend_reads():
    kvh, d, bs = 2, 32, 16
    kv = torch.zeros(4, kvh, bs, 2 * d)
    key, value = torch.randn(3, kvh * d), torch.randn(3, kvh * d)
    DARTreeGPUAttentionImpl(4, d, 1.0, kvh, None, None, "auto").do_kv_cache_update(
        None, key, value, kv, torch.tensor([5, -1, 40]))
    k_cache, v_cache = kv_views(kv, d)
    assert torch.equal(k_cache[0, 5], key[0].view(kvh, d))
    assert torch.equal(v_cache[2, 8], value[2].view(kvh, d))
    assert int((kv != 0).any(-1).sum()) == 2 * kvh   # two slots (slot -1 dropped) x KVH


def test_gpu_backend_declares_what_it_serves():
    b = DARTreeGPUAttentionBackend
    assert b.get_name() == "CUSTOM"
    assert b.supports_head_size(64) and b.supports_head_size(128)
    assert not b.supports_head_size(80)
    assert b.supports_dtype(torch.bfloat16) and not b.supports_kv_cache_dtype("fp8")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        DARTreeGPUAttentionImpl(4, 64, 1.0, 2, None, 128, "auto")


@pytest.fixture
def cuda_platform(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    yield
    AttentionBackendEnum.CUSTOM.clear_override()


def test_plugin_selects_the_gpu_worker_and_backend_on_cuda(tiny, cuda_platform):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_dartree.engine.plugin import GPU_WORKER, _translate_engine_args
    args = EngineArgs(model=str(tiny["target"]), speculative_config=dartree_spec(tiny["drafter"]))
    _translate_engine_args(args)
    assert args.worker_cls == GPU_WORKER
    assert args.attention_backend == AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum.CUSTOM.get_class() is DARTreeGPUAttentionBackend
    assert args.speculative_config["method"] == "custom_class"


def test_plugin_refuses_another_attention_backend_on_cuda(tiny, cuda_platform):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dartree.engine.plugin import DartreeConfigError, _translate_engine_args
    args = EngineArgs(model=str(tiny["target"]), attention_backend="FLASH_ATTN",
                      speculative_config=dartree_spec(tiny["drafter"]))
    with pytest.raises(DartreeConfigError, match="FLASH_ATTN"):
        _translate_engine_args(args)


def test_plugin_refuses_other_platforms(tiny, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from vllm_dartree.engine.plugin import DartreeConfigError, _translate_engine_args
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    args = EngineArgs(model=str(tiny["target"]), speculative_config=dartree_spec(tiny["drafter"]))
    with pytest.raises(DartreeConfigError, match="NVIDIA GPUs"):
        _translate_engine_args(args)


def test_gpu_worker_installs_the_dartree_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dartree.engine.gpu_worker import DARTreeGPUModelRunner
    from vllm_dartree.engine.runner import DARTreeRunnerMixin
    mro = DARTreeGPUModelRunner.__mro__
    assert mro.index(DARTreeRunnerMixin) < mro.index(GPUModelRunner)
