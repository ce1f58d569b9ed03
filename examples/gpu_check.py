"""One prepared check for a lent GPU: tree-attention kernel accuracy and speed, and the DARTree
round's latency (eager vs CUDA graph vs the sequential heap), in at most a few minutes.

    python examples/gpu_check.py            # on the GPU machine; writes $OUT/gpu_check.json
    TRITON_INTERPRET=1 python examples/gpu_check.py --smoke   # tiny shapes on CPU, to test

Runs from a plain checkout (no install): the repository root goes on sys.path and
`csrc_triton` is aliased as `vllm_dartree.csrc_triton`. Needs torch, triton and pydantic.
(a) kernel vs torch reference, relative error; (b) time of the kernel on tree rows vs the same
kernel on causal rows vs SDPA with an explicit mask, at Qwen3-4B shapes (32 query / 8 KV heads,
head 128; contexts 1k and 8k; trees of 64 and 128 nodes; batch 1 and 8); (c) DARTree pruned
round (construction + masks + greedy walk) at Qwen3-4B drafter shapes, random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import csrc_triton  # noqa: E402

sys.modules.setdefault("vllm_dartree.csrc_triton", csrc_triton)

from vllm_dartree import DARTreeConfig  # noqa: E402
from vllm_dartree.attention import PagedBatch, paged_attention_reference  # noqa: E402
from vllm_dartree.csrc_triton.tree_attention import tree_attention  # noqa: E402
from vllm_dartree.drafter import DominoGRUHead  # noqa: E402
from vllm_dartree.tree import ancestor_bitmask, ancestor_mask, build_tree, greedy_walk  # noqa: E402


def _timer(device):
    def run(fn, repeats):
        fn()
        samples = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                fn()
                samples.append(1000 * (time.perf_counter() - t))
        return statistics.median(samples)
    return run


def _paged(batch, ctx, nodes, heads, kv_heads, dim, dtype, device, tree, seed):
    """`batch` requests, each: `ctx` context tokens + 1 + nodes query rows (a random tree)."""
    gen = torch.Generator().manual_seed(seed)
    block, q_len, seq = 16, 1 + nodes, ctx + 1 + nodes
    per = (seq + block - 1) // block
    perm = torch.randperm(batch * per, generator=gen)
    k = torch.randn(batch * per, block, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(batch * per, block, kv_heads, dim, generator=gen).to(dtype)
    table = perm.view(batch, per)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen))
                                               for i in range(1, nodes)])
                           for _ in range(batch)])
    pb = PagedBatch(torch.arange(batch + 1) * q_len, torch.full((batch,), seq), table,
                    torch.full((batch,), tree), ancestor_bitmask(parents))
    q = torch.randn(batch * q_len, heads, dim, generator=gen).to(dtype)
    move = lambda t: t.to(device)  # noqa: E731
    pb = PagedBatch(*(move(t) for t in (pb.query_start_loc, pb.seq_lens, pb.block_table,
                                         pb.is_tree, pb.tree_mask)))
    return move(q), move(k), move(v), pb, q_len


def _kernel(q, k, v, pb, q_len, scale):
    return tree_attention(q, k, v, pb.query_start_loc, pb.seq_lens, pb.block_table, pb.is_tree,
                          pb.tree_mask, scale, q_len)


def check_accuracy(grid, device, dtype) -> list[dict]:
    rows = []
    for batch, ctx, nodes, heads, kv_heads, dim in grid:
        q, k, v, pb, q_len = _paged(batch, ctx, nodes, heads, kv_heads, dim, dtype, device,
                                    True, seed=ctx + nodes)
        got = _kernel(q, k, v, pb, q_len, dim ** -0.5).float()
        ref = paged_attention_reference(q, k, v, pb, dim ** -0.5).float()
        err = float((got - ref).norm() / ref.norm())
        rows.append(dict(batch=batch, ctx=ctx, nodes=nodes, dtype=str(dtype), rel_err=err))
    return rows


def time_attention(grid, device, dtype, repeats) -> list[dict]:
    timer, rows = _timer(device), []
    for batch, ctx, nodes in grid:
        q, k, v, pb, q_len = _paged(batch, ctx, nodes, 32, 8, 128, dtype, device, True, 1)
        causal = PagedBatch(pb.query_start_loc, pb.seq_lens, pb.block_table,
                            torch.zeros_like(pb.is_tree), pb.tree_mask)
        tree_ms = timer(lambda: _kernel(q, k, v, pb, q_len, 128 ** -0.5), repeats)
        causal_ms = timer(lambda: _kernel(q, k, v, causal, q_len, 128 ** -0.5), repeats)
        seq = ctx + q_len   # SDPA over dense K/V with an explicit boolean mask
        dq = q.view(batch, q_len, 32, 128).transpose(1, 2)
        dk = torch.randn(batch, 32, seq, 128, device=device, dtype=dtype)
        mask = torch.ones(batch, 1, q_len, seq, dtype=torch.bool, device=device)
        sdpa_ms = timer(lambda: torch.nn.functional.scaled_dot_product_attention(
            dq, dk, dk, attn_mask=mask), repeats)
        rows.append(dict(batch=batch, ctx=ctx, nodes=nodes, tree_ms=tree_ms,
                         causal_ms=causal_ms, sdpa_mask_ms=sdpa_ms,
                         tree_over_causal=tree_ms / causal_ms))
    return rows


def time_round(batches, device, dtype, shapes, repeats) -> list[dict]:
    hidden, gru, emb, vocab, depths = shapes
    gen = torch.Generator().manual_seed(0)
    embed = (0.02 * torch.randn(vocab, hidden, generator=gen)).to(dtype).to(device)
    head = DominoGRUHead(hidden, gru, emb, vocab, embed).to(device=device, dtype=dtype).eval()
    head.use_input_table()
    timer, rows = _timer(device), []
    for batch in batches:
        logits = torch.randn(batch, depths, vocab, device=device, dtype=dtype)
        hid = torch.randn(batch, depths, hidden, device=device, dtype=dtype)
        roots = torch.randint(0, vocab, (batch,), device=device)
        target = torch.randn(batch, 65, vocab, device=device, dtype=dtype)
        cfg = DARTreeConfig()

        def one_round():
            tree = build_tree(cfg, logits, hid, roots, head)
            mask = ancestor_mask(tree.parents)
            return greedy_walk(tree, target, mask)

        with torch.no_grad():
            eager = timer(one_round, repeats)
            heap_cfg = DARTreeConfig(builder="sequential-heap")
            heap = timer(lambda: build_tree(heap_cfg, logits, hid, roots, head),
                         max(1, repeats // 4))
            graph_ms, graph_err = None, None
            if device.type == "cuda":
                try:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(3):
                            one_round()
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        one_round()
                    graph_ms = timer(graph.replay, repeats)
                except Exception as err:  # noqa: BLE001 - recorded, not hidden
                    graph_err = repr(err)[:300]
        rows.append(dict(batch=batch, eager_ms=eager, cuda_graph_ms=graph_ms,
                         cuda_graph_error=graph_err, sequential_heap_ms=heap,
                         heap_over_eager=heap / eager))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpreter)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(os.environ.get("OUT", "gpu_check_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        acc_grid = [(2, 40, 16, 4, 2, 64)]
        att_grid, batches, reps = [(1, 64, 16)], [1], 2
        shapes, dtype = (64, 32, 16, 1000, 16), torch.float32
    else:
        acc_grid = [(b, c, n, 32, 8, 128) for b in (1, 8) for c in (1024, 8192) for n in (64, 128)]
        att_grid, batches, reps = [(b, c, n) for b in (1, 8) for c in (1024, 8192)
                                   for n in (64, 128)], [1, 8], 20
        shapes, dtype = (2560, 1024, 256, 151936, 16), torch.bfloat16
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    report["accuracy"] = check_accuracy(acc_grid, device, dtype)
    report["attention"] = time_attention(att_grid, device, dtype, reps)
    report["round"] = time_round(batches, device, dtype, shapes, reps)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"device {report['device']}, torch {report['torch']}, {dtype}")
    print("max kernel rel err:", max(r["rel_err"] for r in report["accuracy"]))
    print("| batch | ctx | nodes | tree ms | causal ms | SDPA+mask ms | tree/causal |")
    for r in report["attention"]:
        print(f"| {r['batch']} | {r['ctx']} | {r['nodes']} | {r['tree_ms']:.3f} | "
              f"{r['causal_ms']:.3f} | {r['sdpa_mask_ms']:.3f} | {r['tree_over_causal']:.2f} |")
    print("| batch | round eager ms | round CUDA graph ms | sequential heap ms |")
    for r in report["round"]:
        graph = f"{r['cuda_graph_ms']:.3f}" if r["cuda_graph_ms"] else str(r["cuda_graph_error"])
        print(f"| {r['batch']} | {r['eager_ms']:.3f} | {graph} | {r['sequential_heap_ms']:.3f} |")


if __name__ == "__main__":
    main()
