"""Launch settings of the Triton tree-attention kernel against SDPA causal, on a GPU.

    python examples/attention_sweep.py          # writes $OUT/attention_sweep.json

Qwen3-4B attention shapes (32 query / 8 KV heads, head 128, bf16, vLLM-style paged K/V with
16-token blocks): trees of 16-128 nodes and decode rows, batch 1-32, contexts 1k-8k. For each
shape: the kernel's defaults (64-key tiles, key slices sized from `max_seq_len`, as the GPU
backend calls it) and variants (8 warps, pipeline stages 1/2/4, 32- or 128-key tiles, one
slice), each checked against the one-slice 32-key result, and PyTorch SDPA with a lower-right
causal mask over dense K/V (flash / efficient kernels; not GQA-aware, so it reads 4x the K/V
on decode rows). Times are medians of 30 launches from Python (launch overhead included, as in
eager attention between vLLM's piecewise CUDA graphs). Needs what gpu_check.py needs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as g  # noqa: E402  (puts the repository on sys.path, aliases csrc_triton)
import torch  # noqa: E402

SHAPES = [(1, 1024, 64), (1, 8192, 64), (8, 8192, 64), (8, 8192, 128), (1, 8192, 0),
          (32, 2048, 0), (32, 2048, 16)]   # (batch, context, tree nodes; 0 = one decode row)
VARIANTS = [("default", {}), ("warps8", dict(num_warps=8)), ("stages1", dict(num_stages=1)),
            ("stages2", dict(num_stages=2)), ("stages4", dict(num_stages=4)),
            ("keys128_warps8", dict(block_n=128, num_warps=8)), ("keys32", dict(block_n=32)),
            ("one_slice", dict(num_splits=1))]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("attention_sweep.py times CUDA kernels: run it on a GPU")
    dev = torch.device("cuda")
    timer = g._timer(dev)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention.bias import causal_lower_right
    rows = []
    for batch, ctx, nodes in SHAPES:
        q, k, v, pb, q_len = g._paged(batch, ctx, nodes, 32, 8, 128, torch.bfloat16, dev,
                                      nodes > 0, 1)
        seq, scale = ctx + q_len, 128 ** -0.5
        row = dict(batch=batch, ctx=ctx, nodes=nodes)
        ref = g._kernel(q, k, v, pb, q_len, scale, num_splits=1, block_n=32).float()
        for name, kw in VARIANTS:
            kw = dict(max_seq_len=seq, **kw)
            out = g._kernel(q, k, v, pb, q_len, scale, **kw).float()
            row[f"{name}_rel_err"] = float((out - ref).norm() / ref.norm())
            row[f"{name}_ms"] = timer(lambda: g._kernel(q, k, v, pb, q_len, scale, **kw), 30)
        dq = q.view(batch, q_len, 32, 128).transpose(1, 2)
        dk = torch.randn(batch, 32, seq, 128, device=dev, dtype=torch.bfloat16)
        bias = causal_lower_right(q_len, seq)
        row["sdpa_causal_ms"] = timer(lambda: sdpa(dq, dk, dk, attn_mask=bias), 30)
        rows.append(row)
        print(json.dumps({key: round(val, 4) if isinstance(val, float) else val
                          for key, val in row.items() if not key.endswith("_err")}), flush=True)
    out_dir = Path(os.environ.get("OUT", "gpu_check_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention_sweep.json").write_text(json.dumps(rows, indent=1))
    worst = max(val for row in rows for key, val in row.items() if key.endswith("_rel_err"))
    print(f"largest difference from the one-slice 32-key result: {worst:.2e}")


if __name__ == "__main__":
    main()
