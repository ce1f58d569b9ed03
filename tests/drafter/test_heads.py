"""Loaded correction heads against their formulas, and DARTree on a real tiny Domino drafter."""

import itertools
import math

import torch

from tests.helpers import assert_valid_tree, node_paths
from vllm_dartree import DARTreeConfig
from vllm_dartree.drafter import ContextCache
from vllm_dartree.tree import build_tree


def test_gru_head_equals_torch_gru_and_mlp(tiny_target, drafter_folders):
    head = tiny_target.load(drafter_folders["domino"]).head
    embed = head.embed_weight
    gru = torch.nn.GRU(embed.shape[1], head.gru_hidden_size, batch_first=True, bias=False)
    gru.load_state_dict({"weight_ih_l0": head.w_ih, "weight_hh_l0": head.w_hh})
    tokens = torch.tensor([[5, 17, 300, 2]])
    with torch.no_grad():
        seq, _ = gru(embed[tokens])                                  # states after each token
        state = head.init(tokens[:, 0])
        for t in range(1, tokens.shape[1]):
            state = head.advance(state, tokens[:, t:t + 1])
        torch.testing.assert_close(state[0, 0], seq[0, -1], rtol=1e-5, atol=1e-6)
        z = torch.randn(1, embed.shape[1])
        mlp = head.embed_proj
        expected = mlp[2](torch.nn.functional.silu(mlp[0](torch.cat([z, seq[:, -1]], -1))))
        torch.testing.assert_close(head.correction(z, seq[:, -1]), expected)


def test_markov_head_equals_its_formula(tiny_target, drafter_folders):
    head = tiny_target.load(drafter_folders["dspark"]).head
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    cand = torch.tensor([[[3, 99, 400, 7]]])                        # [R=1, D=1, K=4]
    prev = torch.tensor([[11, 250]])                                # [R=1, P=2]
    with torch.no_grad():
        got = head.score(head.prepare(None, cand), 0, prev)         # [1, 2, 4]
        for p in range(2):
            for j, c in enumerate(cand[0, 0].tolist()):
                assert math.isclose(float(got[0, p, j]), float(w2[c] @ w1[prev[0, p]]),
                                    rel_tol=1e-5, abs_tol=1e-6)
        torch.testing.assert_close(head.bias(prev)[0, :, cand[0, 0]], got[0])
    assert head.num_uncorrected == 0


def _draft(tiny_target, drafter, root=77):
    feats = tiny_target.features(torch.arange(30, 45), drafter.spec.target_layer_ids)
    cache = ContextCache()
    drafter.backbone.extend_context(cache, ["r"], [feats])
    return drafter.backbone(cache, ["r"], torch.tensor([root]))


def test_dartree_on_a_tiny_domino_drafter_equals_brute_force(tiny_target, drafter_folders):
    """Every node's score equals the per-path computation: GRU along the path, full-vocabulary
    correction gathered at the depth's top-K candidates, renormalised over them."""
    drafter = tiny_target.load(drafter_folders["domino"])
    out, root, k, depth = _draft(tiny_target, drafter), 77, 3, 3
    config = DARTreeConfig(variant="fixed", budget=k + k * k + k ** 3, topk=k, max_depth=depth)
    with torch.no_grad():
        tree = build_tree(config, out.base_logits, out.hidden, torch.tensor([root]), drafter.head)
    assert_valid_tree(tree, config.budget, depth)
    head, base, hid = drafter.head, out.base_logits[0], out.hidden[0]
    cands = [torch.topk(base[d], k).indices for d in range(depth)]
    expected = {}
    with torch.no_grad():
        for d in range(1, depth + 1):
            for path in itertools.product(*(c.tolist() for c in cands[:d])):
                score, state = 0.0, head.init(torch.tensor([root]))[0, 0]
                for i, tok in enumerate(path):
                    if i == 0:   # depth 1: uncorrected, full-vocabulary normalisation
                        score += float(torch.log_softmax(base[0], -1)[tok])
                    else:
                        full = base[i] + head.correction(hid[i], state)
                        log_q = torch.log_softmax(full[cands[i]], -1)
                        score += float(log_q[cands[i].tolist().index(tok)])
                    state = head.gru_step(state, torch.tensor(tok))
                expected[path] = score
    got = node_paths(tree, 0)
    assert got.keys() == expected.keys()
    assert all(math.isclose(got[p], expected[p], abs_tol=1e-4) for p in got)


def test_every_builder_runs_on_every_format(tiny_target, drafter_folders):
    for fmt, folder in drafter_folders.items():
        drafter = tiny_target.load(folder)
        out = _draft(tiny_target, drafter)
        for builder in ("dartree", "ddtree", "chain", "sequential-heap"):
            if builder == "sequential-heap" and drafter.head is None:
                continue
            cfg = DARTreeConfig(builder=builder, budget=16, width=4, topk=8)
            with torch.no_grad():
                tree = build_tree(cfg, out.base_logits, out.hidden, torch.tensor([77]),
                                  drafter.head)
            assert_valid_tree(tree, max(16, drafter.spec.num_depths), drafter.spec.num_depths)
