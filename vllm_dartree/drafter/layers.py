"""Qwen3-style pieces of the drafter backbone: RMSNorm, RoPE, attention over context + block.

Module and parameter names match the released checkpoints (`self_attn.q_proj`, `q_norm`,
`mlp.gate_proj`, `input_layernorm`, ...), so a state dict loads without renaming.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "rope_cos_sin", "apply_rope", "DraftLayer", "linear"]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in]^T, fast for the few rows a draft block or tree depth has.

    A weight may carry `_dt_packed`, a callable an engine attached to it (contiguous rows
    [M, in] -> [M, out]; on CPU vLLM's oneDNN matmul, `engine.drafters.pack_for_cpu`): it is
    used unless autograd needs the product. NOTE: otherwise on CPU (MKL, this project's
    machines), `x @ W.T` with 2..128 rows runs 1.3-3x slower than `(W @ x.T).T` (median, fp32,
    2 threads: 4 x 1024 -> 3072: 2.33 vs 0.85 ms; 16 x 2560 -> 9728: 59 vs 18 ms; 16 x 2560
    -> 151936: 534 vs 270 ms); one row is faster the usual way. Same products, another
    summation order. CUDA uses F.linear.
    """
    rows = x.reshape(-1, x.shape[-1]).to(weight.dtype)
    packed = getattr(weight, "_dt_packed", None)
    if packed is not None and rows.shape[0] and not (rows.requires_grad
                                                    and torch.is_grad_enabled()):
        out = packed(rows.contiguous())
    elif rows.is_cuda or rows.shape[0] == 1:
        out = nn.functional.linear(rows, weight)
    else:
        out = (weight @ rows.T).T
    return out.reshape(*x.shape[:-1], weight.shape[0])


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., head_dim], computed in fp32 (as the reference does)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, D] with cos/sin [..., T, D] (rotate-half convention of Qwen3)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., T, H] -> K, V [..., KVH, T, D] (K normed and rotated)."""
        k = self.k_norm(linear(x, self.k_proj.weight).unflatten(-1, (self.kv_heads, self.head_dim)))
        v = linear(x, self.v_proj.weight).unflatten(-1, (self.kv_heads, self.head_dim))
        k = apply_rope(k.transpose(-3, -2), cos.unsqueeze(-3), sin.unsqueeze(-3))
        return k, v.transpose(-3, -2)


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = nn.functional.silu(linear(x, self.gate_proj.weight))
        return linear(gate * linear(x, self.up_proj.weight), self.down_proj.weight)


class DraftLayer(nn.Module):
    """One decoder layer whose queries are the block and whose keys/values are the cached
    context K/V followed by the block's own K/V (non-causal inside the block)."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int,
                 head_dim: int, eps: float):
        super().__init__()
        self.self_attn = _Attention(hidden, heads, kv_heads, head_dim, eps)
        self.mlp = _MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                ctx_valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                queries: slice | None = None) -> torch.Tensor:
        """x [R, Q, H]; ctx_k/ctx_v [R, KVH, L, D]; ctx_valid [R, L] bool; cos/sin [R, Q, D].

        `queries` (the last layer of a draft): only those block positions are returned,
        [R, Q', H]; every block position still gives its keys and values, so the kept rows
        are what the whole block would give them (a query's attention and MLP see only its
        own row), for a fraction of the projections and the MLP."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        k_blk, v_blk = attn.keys_values(h, cos, sin)                            # [R, KVH, Q, D]
        if queries is not None:
            x, h, cos, sin = x[:, queries], h[:, queries], cos[:, queries], sin[:, queries]
        q = attn.q_norm(linear(h, attn.q_proj.weight).unflatten(-1, (attn.heads, attn.head_dim)))
        q = apply_rope(q.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))   # [R, NH, Q', D]
        k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], dim=2)
        v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], dim=2)
        visible = torch.cat([ctx_valid, ctx_valid.new_ones(x.shape[0], k_blk.shape[2])], dim=1)
        # grouped-query attention without copying K/V per query head (2-8x faster on CPU
        # than repeat_interleave at 1-4 requests and a few hundred context tokens)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None, None],
                                                         enable_gqa=attn.heads != attn.kv_heads)
        x = x + linear(out.transpose(1, 2).flatten(2), attn.o_proj.weight)
        return x + self.mlp(self.post_attention_layernorm(x))
