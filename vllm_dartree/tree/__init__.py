"""Engine-agnostic tree speculation: build, flatten, mask and verify draft trees (pure torch).

Words used throughout (defined once, here):
- root: the last committed token of a request (the previous round's bonus token); it is
  column 0 of the verification input `[root] + nodes` and is not a draft node.
- node i: a draft token at column i + 1; `parents[i]` is its parent's node index, -1 for the
  root, and always `parents[i] < i` (topological order), so any prefix of the order is a tree.
- depth: 1 for the root's children; a node's position is `p0 + depth` (p0 = root position).
- budget B: the most nodes verified per request and round (static width of a TreeBatch).
- ancestor mask: row i + 1 sees the root, node i's ancestors and node i itself.
- score: a node's path log-probability under the drafter; DARTree ranks by
  `score + depth_bonus * depth`.
"""

from vllm_dartree.tree.build import (
    CandidateTables,
    build_chain,
    build_chain_ddtree,
    build_dartree,
    build_ddtree,
    candidate_tables,
    fixed_quotas,
    grow,
    pruned_quotas,
    select_top_b,
)
from vllm_dartree.tree.construct import build_tree, num_candidates
from vllm_dartree.tree.heads import CorrectionHead, MarkovToyHead, NoHead
from vllm_dartree.tree.heap import best_first_select, build_sequential_heap, ddtree_heap
from vllm_dartree.tree.render import format_tree
from vllm_dartree.tree.structure import (
    TreeBatch,
    ancestor_bitmask,
    ancestor_mask,
    best_first_order,
    bitmask_to_mask,
    mask_to_bitmask,
    tree_positions,
    truncate,
    valid_node_mask,
)
from vllm_dartree.tree.verify import (
    WalkResult,
    greedy_walk,
    sample_target_tokens,
    sampled_walk,
    walk,
)

__all__ = [
    "CandidateTables", "CorrectionHead", "MarkovToyHead", "NoHead", "TreeBatch", "WalkResult",
    "ancestor_bitmask", "ancestor_mask", "best_first_order", "best_first_select",
    "bitmask_to_mask", "build_chain",
    "build_chain_ddtree", "build_dartree", "build_ddtree", "build_sequential_heap",
    "build_tree", "candidate_tables", "ddtree_heap", "fixed_quotas", "format_tree",
    "greedy_walk", "grow", "mask_to_bitmask", "num_candidates", "pruned_quotas",
    "sample_target_tokens", "sampled_walk", "select_top_b", "tree_positions", "truncate",
    "valid_node_mask", "walk",
]
