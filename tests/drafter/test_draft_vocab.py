"""A reduced draft vocabulary: chosen by frequency (brute-force oracle), stored and validated
in the checkpoint, and mapped back to target ids by every tree builder: a tree built from
the N draft columns equals the tree built from the full vocabulary with every other token
masked out, so tokens outside the draft vocabulary are simply never proposed."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dartree.config import DARTreeConfig
from vllm_dartree.drafter import (
    CheckpointError,
    DFlashBackbone,
    DominoGRUHead,
    TargetInfo,
    load_drafter,
    parse_drafter_config,
)
from vllm_dartree.testing import write_tiny_drafter, write_tiny_target
from vllm_dartree.tree import build_tree
from vllm_dartree.zoo.draft_vocab import coverage, select_draft_vocab

H, G, E, V, N = 12, 10, 6, 40, 17


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 19), min_size=0, max_size=30),
                          st.integers(0, 10)), min_size=1, max_size=5),
       st.integers(1, 20), st.lists(st.integers(0, 19), max_size=3))
def test_selection_is_the_most_frequent_response_tokens(seqs, size, always):
    always = sorted(set(always))[:size]
    sequences = [(torch.tensor(t, dtype=torch.long), start) for t, start in seqs]
    got = select_draft_vocab(sequences, size, 20, always=always).tolist()
    counts = Counter(tok for t, start in seqs for tok in t[start:])
    # brute force: forced ids first, then by count descending, ties by ascending id
    ranked = sorted(range(20), key=lambda i: (i not in always, -counts[i], i))
    assert got == sorted(ranked[:size])
    total = sum(len(t[start:]) for t, start in seqs)
    inside = sum(1 for t, start in seqs for tok in t[start:] if tok in got)
    assert coverage(sequences, torch.tensor(got)) == pytest.approx(inside / max(1, total))


def _full_and_reduced(seed):
    """A GRU head over the full vocabulary and its restriction to N random columns."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=gen, dtype=torch.float64)
    full = DominoGRUHead(H, G, E, V, embed).double()
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    ids = torch.randperm(V, generator=gen)[:N].sort().values
    reduced = DominoGRUHead(H, G, E, N, embed).double()
    with torch.no_grad():
        reduced.prefix_gru.load_state_dict(full.prefix_gru.state_dict())
        reduced.embed_proj[0].weight.copy_(full.embed_proj[0].weight)
        reduced.embed_proj[2].weight.copy_(full.embed_proj[2].weight[ids])
    return full, reduced, ids


@pytest.mark.parametrize("builder,extra", [
    ("dartree", {"variant": "pruned"}), ("dartree", {"variant": "fixed"}), ("ddtree", {}),
    ("chain", {}), ("sequential-heap", {}), ("chain-ddtree", {})])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_builder_maps_draft_columns_to_target_ids(builder, extra, seed):
    full, reduced, ids = _full_and_reduced(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    num_req, depths = 3, 5
    logits = 2 * torch.randn(num_req, depths, N, generator=gen, dtype=torch.float64)
    hidden = torch.randn(num_req, depths, H, generator=gen, dtype=torch.float64)
    roots = torch.randint(0, V, (num_req,), generator=gen)
    masked = torch.full((num_req, depths, V), float("-inf"), dtype=torch.float64)
    masked[:, :, ids] = logits
    config = DARTreeConfig(builder=builder, budget=12, width=4, topk=6, **extra)
    with torch.no_grad():
        got = build_tree(config, logits, hidden, roots, reduced, vocab_ids=ids)
        want = build_tree(config, masked, hidden, roots, full)
    for name in ("tokens", "parents", "depths", "scores", "num_nodes"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=name)
    live = torch.arange(got.tokens.shape[1])[None] < got.num_nodes[:, None]
    assert bool(torch.isin(got.tokens[live], ids).all())   # never outside the draft vocab


def test_backbone_scores_the_draft_columns_only():
    spec = parse_drafter_config({
        "architectures": ["DFlashDraftModel"], "hidden_size": H, "intermediate_size": 24,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 6, "vocab_size": V, "block_size": 4, "draft_vocab_size": N,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": [0]}})
    assert spec.output_size == N
    lm_head = torch.randn(V, H)
    backbone = DFlashBackbone(spec, torch.randn(V, H), lm_head)
    ids = torch.randperm(V)[:N].sort().values
    backbone.set_draft_vocab(ids)
    torch.testing.assert_close(backbone.output_weight, lm_head[ids])
    tokens = torch.tensor([int(ids[3]), -100, int(ids[0]),
                           next(t for t in range(V) if t not in ids.tolist())])
    assert backbone.draft_columns(tokens).tolist() == [3, -1, 0, -1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_vocab")
    target = write_tiny_target(root / "target", seed=3)
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(target)
    return root, target, TargetInfo(cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers)


def _load(folder, info):
    return load_drafter(folder, info, torch.randn(info.vocab_size, info.hidden_size),
                        torch.randn(info.vocab_size, info.hidden_size), dtype=torch.float32)


@pytest.mark.parametrize("fmt", ["domino", "dflash"])
def test_checkpoint_round_trip(tiny, fmt):
    root, target, info = tiny
    folder = write_tiny_drafter(root / fmt, fmt, target, layers=1, draft_vocab=64)
    drafter = _load(folder, info)
    assert drafter.spec.draft_vocab_size == 64 and drafter.vocab_ids.shape == (64,)
    assert bool((drafter.vocab_ids[1:] > drafter.vocab_ids[:-1]).all())
    if fmt == "domino":
        assert drafter.head.embed_proj[2].weight.shape[0] == 64


def _rewrite(folder, ids=None, drop=False, config=None):
    import json

    from safetensors.torch import load_file, save_file
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    if drop:
        tensors.pop("draft_vocab_ids")
    elif ids is not None:
        tensors["draft_vocab_ids"] = ids
    save_file(tensors, str(path))
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config)
        (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case,match", [
    ("unsorted", "strictly increasing"), ("repeat", "strictly increasing"),
    ("range", "must lie in"), ("shape", "expected int64"), ("float", "expected int64"),
    ("missing", "no shard holds"), ("no-config", "no draft_vocab_size"),
    ("too-big", "draft_vocab_size")])
def test_checkpoint_errors_name_the_problem(tiny, case, match):
    root, target, info = tiny
    folder = write_tiny_drafter(root / f"bad-{case}", "domino", target, layers=1, draft_vocab=8)
    good = torch.arange(8) * 3
    if case == "unsorted":
        _rewrite(folder, good.flip(0))
    elif case == "repeat":
        _rewrite(folder, torch.tensor([0, 1, 1, 2, 3, 4, 5, 6]))
    elif case == "range":
        _rewrite(folder, good + info.vocab_size)
    elif case == "shape":
        _rewrite(folder, torch.arange(9))
    elif case == "float":
        _rewrite(folder, good.float())
    elif case == "missing":
        _rewrite(folder, drop=True)
    elif case == "no-config":
        _rewrite(folder, config={"draft_vocab_size": 0})
    elif case == "too-big":
        _rewrite(folder, config={"draft_vocab_size": info.vocab_size + 1})
    with pytest.raises((CheckpointError, ValueError), match=match):
        _load(folder, info)
