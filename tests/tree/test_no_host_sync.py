"""The production tree paths never synchronise with the host inside a round.

A TorchDispatchMode records every aten op; the ones that need a device -> host copy
(`.item()`, `.tolist()`, `bool(tensor)`, `nonzero`, masked_select ...) must not appear.
On CPU this is the same property that lets a GPU round run without stalls and be captured
in a CUDA graph.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_dartree import DARTreeConfig
from vllm_dartree.drafter import DominoGRUHead
from vllm_dartree.tree import (
    MarkovToyHead,
    ancestor_bitmask,
    ancestor_mask,
    build_tree,
    greedy_walk,
    sample_target_tokens,
    tree_positions,
    walk,
)

SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "unique_dim",
           "_unique2", "repeat_interleave"}


class _NoSync(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _inputs(head_kind):
    gen = torch.Generator().manual_seed(0)
    num_req, depth, vocab, hidden = 3, 6, 50, 8
    logits = torch.randn(num_req, depth, vocab, generator=gen)
    roots = torch.randint(0, vocab, (num_req,), generator=gen)
    hid = torch.randn(num_req, depth, hidden, generator=gen)
    if head_kind == "gru":
        head = DominoGRUHead(hidden, 6, 5, vocab, torch.randn(vocab, hidden, generator=gen))
    else:
        head = MarkovToyHead(torch.randn(depth, vocab, vocab, generator=gen))
    return logits, hid, roots, head


@pytest.mark.parametrize("head_kind", ["gru", "markov"])
@pytest.mark.parametrize("config", [
    DARTreeConfig(budget=16, width=4, topk=8),
    DARTreeConfig(variant="fixed", budget=16, topk=8),
    DARTreeConfig(builder="ddtree", budget=16, topk=8),
    DARTreeConfig(builder="chain", topk=8),
    DARTreeConfig(builder="chain-ddtree", budget=16, topk=8),
], ids=["pruned", "fixed", "ddtree", "chain", "chain-ddtree"])
def test_a_whole_round_has_no_host_sync(head_kind, config):
    logits, hid, roots, head = _inputs(head_kind)
    with torch.no_grad(), _NoSync() as mode:
        tree = build_tree(config, logits, hid, roots, head)
        mask = ancestor_mask(tree.parents)
        ancestor_bitmask(tree.parents)
        tree_positions(tree, torch.tensor([5, 9, 14]))
        target_logits = torch.randn(3, 1 + tree.max_nodes, logits.shape[-1])
        greedy_walk(tree, target_logits, mask)
        tokens = sample_target_tokens(target_logits, torch.tensor([0.0, 1.0, 0.7]),
                                      torch.tensor([0, 5, 3]), torch.tensor([1.0, 0.9, 0.5]))
        res = walk(tree, tokens, mask)
        res.output_tokens(tree)
    assert mode.seen == [], f"host synchronisation inside a round: {sorted(set(mode.seen))}"


def test_the_detector_sees_a_sync():
    with _NoSync() as mode:
        torch.tensor([1.0, 2.0]).sum().item()
    assert mode.seen == ["_local_scalar_dense"]
