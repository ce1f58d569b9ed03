"""`GraphedTreeBuilder`: a round's tree construction replayed from CUDA graphs.

`build_tree` has static shapes for a given (R, D, V, H, config) and never synchronises with
the host (tests/tree/test_no_host_sync.py), so one round of it (candidate tables, the
depth-by-depth growth with the correction head, the final selection) and, if asked, the
ancestor bitmask of the result can be captured once and replayed: one launch instead of
hundreds of small kernels and their Python overhead.

Batch sizes are rounded up to a bucket (1, 2, 4, 8, 16, 24, 32, 48, 64, ...); each bucket
is captured on first use with its own static input buffers (all graphs share one memory
pool). Padding rows hold whatever the buffers held before: requests are independent in
every builder, so they never change a real request's tree, and their outputs are dropped.
Batches above the largest bucket, CPU tensors, or `use_graphs=False` run eagerly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from vllm_dartree import ops
from vllm_dartree.config import DARTreeConfig
from vllm_dartree.tree.construct import build_tree
from vllm_dartree.tree.heads import CorrectionHead
from vllm_dartree.tree.structure import TreeBatch

__all__ = ["GraphedTreeBuilder", "DEFAULT_BUCKETS", "capture_graph"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def capture_graph(fn, device: torch.device, pool=None, warmup: int = 2):
    """Capture `fn()` (static inputs it closes over) in a CUDA graph: a few warm-up calls on
    a side stream (allocator, cuBLAS handles, Triton compiles), then the capture. Returns
    (graph, fn's outputs, which every `graph.replay()` rewrites in place)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@dataclass
class _Captured:
    logits: torch.Tensor            # static inputs [bucket, ...]
    hidden: torch.Tensor | None
    roots: torch.Tensor
    tree: TreeBatch                 # static outputs
    mask: torch.Tensor | None
    graph: object | None            # torch.cuda.CUDAGraph, None when padding eagerly


class GraphedTreeBuilder:
    """Callable like `build_tree(config, logits, hidden, roots, head)`; returns
    (TreeBatch, ancestor bitmask [R, 1 + N, words] or None)."""

    def __init__(self, config: DARTreeConfig, head: CorrectionHead | None,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, use_graphs: bool | None = None,
                 with_mask: bool = False, pad: bool = False,
                 vocab_ids: torch.Tensor | None = None):
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets {buckets} must be increasing positive batch sizes")
        self.config, self.head, self.buckets = config, head, tuple(buckets)
        self.use_graphs, self.with_mask = use_graphs, with_mask
        self.pad = pad            # pad to buckets without graphs (tests); default: graphs only
        self.vocab_ids = vocab_ids   # a reduced draft vocabulary's target ids (build_tree)
        self._captured: dict[tuple, _Captured] = {}
        self._pool = None
        self.replays = 0          # rounds served from a graph (for tests and benchmarks)

    def bucket(self, num_requests: int) -> int | None:
        """The captured batch size that serves `num_requests` (None: run eagerly)."""
        i = bisect.bisect_left(self.buckets, num_requests)
        return self.buckets[i] if i < len(self.buckets) else None

    def _round(self, logits, hidden, roots) -> tuple[TreeBatch, torch.Tensor | None]:
        tree = build_tree(self.config, logits, hidden, roots, self.head, self.vocab_ids)
        return tree, ops.ancestor_bitmask(tree.parents) if self.with_mask else None

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, hidden: torch.Tensor | None,
                 roots: torch.Tensor) -> tuple[TreeBatch, torch.Tensor | None]:
        graphs = logits.is_cuda if self.use_graphs is None else self.use_graphs
        if graphs and not logits.is_cuda:
            raise ValueError("CUDA graphs need CUDA tensors (use_graphs=False on CPU)")
        pad = graphs or self.pad
        size = self.bucket(logits.shape[0]) if pad else None
        if size is None:
            return self._round(logits, hidden, roots)
        key = (size, tuple(logits.shape[1:]), logits.dtype, logits.device,
               None if hidden is None else (tuple(hidden.shape[1:]), hidden.dtype))
        captured = self._captured.get(key)
        if captured is None:
            captured = self._capture(size, logits, hidden, roots, graphs)
            self._captured[key] = captured
        r = logits.shape[0]
        captured.logits[:r].copy_(logits)
        if hidden is not None:
            captured.hidden[:r].copy_(hidden)
        captured.roots[:r].copy_(roots)
        if captured.graph is not None:
            captured.graph.replay()
            self.replays += 1
            tree, mask = captured.tree, captured.mask
        else:
            tree, mask = self._round(captured.logits, captured.hidden, captured.roots)
        out = TreeBatch(*(t[:r].clone() for t in (tree.tokens, tree.parents, tree.depths,
                                                   tree.scores, tree.num_nodes)))
        return out, None if mask is None else mask[:r].clone()

    def _capture(self, size, logits, hidden, roots, graphs: bool) -> _Captured:
        def static(t):
            buf = torch.zeros((size, *t.shape[1:]), dtype=t.dtype, device=t.device)
            buf[:t.shape[0]].copy_(t)
            return buf

        s_logits, s_roots = static(logits), static(roots)
        s_hidden = None if hidden is None else static(hidden)
        if not graphs:
            return _Captured(s_logits, s_hidden, s_roots, None, None, None)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, (tree, mask) = capture_graph(lambda: self._round(s_logits, s_hidden, s_roots),
                                            logits.device, self._pool)
        return _Captured(s_logits, s_hidden, s_roots, tree, mask, graph)
