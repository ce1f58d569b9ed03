"""The backbone against a plain re-derivation, cache increments, and batching."""

import math

import pytest
import torch

from vllm_dartree.drafter import ContextCache


def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [T, heads, D] rotated by pairs (i, i + D/2) at angle pos * theta^(-2i/D)."""
    d = x.shape[-1]
    freq = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)])
    ang = pos.float()[:, None, None] * freq
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def _plain_draft(drafter, feats, root):
    """Full attention over [context features ; block], written out from the definitions."""
    bb, spec = drafter.backbone, drafter.spec
    ctx = _rms(feats @ bb.fc.weight.T, bb.hidden_norm.weight)
    n_ctx, q_len = ctx.shape[0], spec.query_len
    x = bb.embed_weight[torch.tensor([root] + [spec.mask_token_id] * (q_len - 1))].float()
    pos_c, pos_b = torch.arange(n_ctx), n_ctx + torch.arange(q_len)
    heads, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    for layer in bb.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight)
        q = _rope(_rms((h @ a.q_proj.weight.T).view(q_len, heads, d), a.q_norm.weight), pos_b,
                  spec.rope_theta)
        k = torch.cat([
            _rope(_rms((ctx @ a.k_proj.weight.T).view(n_ctx, kvh, d), a.k_norm.weight), pos_c,
                  spec.rope_theta),
            _rope(_rms((h @ a.k_proj.weight.T).view(q_len, kvh, d), a.k_norm.weight), pos_b,
                  spec.rope_theta)])
        v = torch.cat([ctx @ a.v_proj.weight.T, h @ a.v_proj.weight.T]).view(-1, kvh, d)
        k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))      # no mask at all
        x = x + out.transpose(0, 1).reshape(q_len, -1) @ a.o_proj.weight.T
        m = layer.mlp
        g = _rms(x, layer.post_attention_layernorm.weight)
        x = x + (torch.nn.functional.silu(g @ m.gate_proj.weight.T) * (g @ m.up_proj.weight.T)) \
            @ m.down_proj.weight.T
    hidden = _rms(x, bb.norm.weight)[spec.depth_offset:spec.depth_offset + spec.num_depths]
    return hidden, hidden @ bb.lm_head_weight.T


@pytest.mark.parametrize("fmt", ["dflash", "domino", "dspark"])
@pytest.mark.parametrize("depths", [1, 3])
def test_capped_depths_equal_the_whole_blocks_first_rows(fmt, depths, tiny_target,
                                                         drafter_folders):
    """`num_depths` computes only the rows read out in the last layer (keys and values still
    from the whole block): the rows equal the whole block's, against the plain derivation,
    for drafters of 2 layers (the first layer's every row feeds the last layer's K/V)."""
    drafter = tiny_target.load(drafter_folders[fmt])
    assert len(drafter.backbone.layers) == 2
    feats = tiny_target.features(_tokens(13, seed=3), drafter.spec.target_layer_ids)
    cache = ContextCache()
    drafter.backbone.extend_context(cache, ["r"], [feats])
    out = drafter.backbone(cache, ["r"], torch.tensor([7]), num_depths=depths)
    hidden, logits = _plain_draft(drafter, feats, 7)
    assert out.hidden.shape == (1, depths, drafter.spec.hidden_size)
    torch.testing.assert_close(out.hidden[0], hidden[:depths], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.base_logits[0], logits[:depths], rtol=1e-4, atol=1e-4)


def _tokens(n, seed=0):
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["dflash", "domino", "dspark"])
def test_backbone_equals_plain_attention(fmt, tiny_target, drafter_folders):
    drafter = tiny_target.load(drafter_folders[fmt])
    feats = tiny_target.features(_tokens(11), drafter.spec.target_layer_ids)
    cache = ContextCache()
    drafter.backbone.extend_context(cache, ["r"], [feats])
    out = drafter.backbone(cache, ["r"], torch.tensor([42]))
    hidden, logits = _plain_draft(drafter, feats, 42)
    assert out.hidden.shape == (1, drafter.spec.num_depths, drafter.spec.hidden_size)
    torch.testing.assert_close(out.hidden[0], hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.base_logits[0], logits, rtol=1e-4, atol=1e-4)


def test_incremental_context_equals_from_scratch(tiny_target, drafter_folders):
    drafter = tiny_target.load(drafter_folders["domino"])
    feats = tiny_target.features(_tokens(20, 1), drafter.spec.target_layer_ids)
    whole, pieces = ContextCache(), ContextCache()
    drafter.backbone.extend_context(whole, ["r"], [feats[:12]])
    for a, b in ((0, 5), (5, 8), (8, 12)):
        drafter.backbone.extend_context(pieces, ["r"], [feats[a:b]])
    root = torch.tensor([7])
    torch.testing.assert_close(drafter.backbone(pieces, ["r"], root).hidden,
                               drafter.backbone(whole, ["r"], root).hidden)
    # trim back (rejected context) and extend again: same as never having gone further
    drafter.backbone.extend_context(pieces, ["r"], [feats[12:20]])
    pieces.trim("r", 12)
    assert pieces.length("r") == 12
    torch.testing.assert_close(drafter.backbone(pieces, ["r"], root).hidden,
                               drafter.backbone(whole, ["r"], root).hidden)
    with pytest.raises(ValueError, match="cannot trim"):
        pieces.trim("r", 13)


def test_batch_equals_one_at_a_time(tiny_target, drafter_folders):
    drafter = tiny_target.load(drafter_folders["dspark"])
    lens = {"a": 4, "b": 13, "c": 9, "d": 0}
    feats = {r: tiny_target.features(_tokens(max(n, 1), i), drafter.spec.target_layer_ids)[:n]
             for i, (r, n) in enumerate(lens.items())}
    batch = ContextCache()
    drafter.backbone.extend_context(batch, list(lens), list(feats.values()))
    roots = torch.tensor([3, 4, 5, 6])
    together = drafter.backbone(batch, list(lens), roots)
    for i, rid in enumerate(lens):
        alone = ContextCache()
        drafter.backbone.extend_context(alone, [rid], [feats[rid]])
        single = drafter.backbone(alone, [rid], roots[i:i + 1])
        torch.testing.assert_close(together.hidden[i], single.hidden[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together.base_logits[i], single.base_logits[0],
                                   rtol=1e-4, atol=1e-4)
    batch.free("b")
    assert "b" not in batch and batch.length("b") == 0


def test_mask_embedding_replaces_the_mask_rows(tiny_target, drafter_folders):
    drafter = tiny_target.load(drafter_folders["dflash"])
    cache = ContextCache()
    a = drafter.backbone(cache, ["x"], torch.tensor([9])).hidden
    drafter.backbone.mask_embedding = torch.nn.Parameter(
        drafter.backbone.embed_weight[drafter.spec.mask_token_id].clone())
    torch.testing.assert_close(drafter.backbone(cache, ["x"], torch.tensor([9])).hidden, a)
    drafter.backbone.mask_embedding = torch.nn.Parameter(torch.zeros(drafter.spec.hidden_size))
    b = drafter.backbone(cache, ["x"], torch.tensor([9])).hidden
    assert not torch.allclose(a, b) and not math.isnan(float(b.sum()))


@pytest.mark.parametrize("fmt", ["dflash", "domino"])
def test_anchored_training_blocks_equal_inference(fmt, tiny_target, drafter_folders):
    """The teacher-forced training path gives, for every anchor, the hidden states that
    inference computes with a context of exactly the tokens before the anchor."""
    drafter = tiny_target.load(drafter_folders[fmt])
    tokens = _tokens(24, 9)
    feats = tiny_target.features(tokens, drafter.spec.target_layer_ids)
    anchors = torch.tensor([0, 3, 11, 23])
    trained = drafter.backbone.anchored_forward(feats, tokens, anchors)
    assert trained.requires_grad                       # gradients flow to the drafter
    for i, a in enumerate(anchors.tolist()):
        cache = ContextCache()
        drafter.backbone.extend_context(cache, ["r"], [feats[:a]])
        ref = drafter.backbone(cache, ["r"], tokens[a:a + 1]).hidden[0]
        torch.testing.assert_close(trained[i].detach(), ref, rtol=1e-5, atol=1e-5)
