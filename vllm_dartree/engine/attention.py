"""What dartree's two attention backends share: vLLM's KV tensor read as K and V views,
KV writes and KV compaction in torch, and the features both refuse at start-up.

vLLM 0.32 hands every backend its per-layer KV tensor in the logical shape
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`. The token-major reading of it
(`kv_views`): K is `[..., :head_size]`, V is `[..., head_size:]`, and the views are
`[num_blocks, block_size, num_kv_heads, head_size]`, the layout of
`vllm_dartree.attention.PagedBatch` and of the Triton kernel. The GPU backend
(`gpu_attention`) always uses it; the CPU backend (`cpu_attention`) uses it where vLLM's
own CPU layout (`cpu_attention.kv_layout`) is not available, and wraps these helpers.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

__all__ = ["kv_views", "copy_slots", "write_slots", "unsupported_features",
           "TreeAttentionImplBase"]


def kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views [num_blocks, block_size, num_kv_heads, head_size] of vLLM's tensor."""
    token_major = kv_cache.permute(0, 2, 1, 3)
    return token_major[..., :head_size], token_major[..., head_size:]


def _slot_index(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """KV compaction on one layer: slot src[i] -> slot dst[i] (all reads before writes)."""
    block_size = kv_cache.shape[2]
    sb, so = _slot_index(src, block_size)
    db, do = _slot_index(dst, block_size)
    kv_cache[db, :, do] = kv_cache[sb, :, so].clone()


def write_slots(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slots: torch.Tensor) -> None:
    """Store key/value [T, KVH, D] at slots [T] (int64 or int32). Rows with slot -1
    (padding) are dropped; that needs the host to know which, so GPU code uses vLLM's
    `triton_reshape_and_cache_flash` instead (same layout, no synchronisation)."""
    slots = slots.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks, offsets = _slot_index(slots, kv_cache.shape[2])
    k_cache, v_cache = kv_views(kv_cache, key.shape[-1])
    k_cache[blocks, offsets] = key.to(kv_cache.dtype)
    v_cache[blocks, offsets] = value.to(kv_cache.dtype)


def unsupported_features(alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap,
                         attn_type, sinks) -> list[str]:
    """What a dartree attention impl refuses, in words (empty: all is well)."""
    problems = []
    if alibi_slopes is not None:
        problems.append("ALiBi")
    if sliding_window is not None:
        problems.append("sliding-window attention")
    if logits_soft_cap:
        problems.append("logit softcapping")
    if sinks is not None:
        problems.append("attention sinks")
    if kv_cache_dtype not in ("auto", None) and "fp8" in str(kv_cache_dtype):
        problems.append("an fp8 KV cache (use kv_cache_dtype='auto')")
    if attn_type != AttentionType.DECODER:
        problems.append(f"{attn_type} attention")
    return problems


class TreeAttentionImplBase(AttentionImpl):
    """vLLM's impl interface for both dartree backends: refuses what neither serves, and
    hands `attend(q [T, NH, D], kv_cache, metadata, out [T, NH, D])` this step's rows."""

    device_name = "?"    # for messages: "CPU" / "GPU"

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None) -> None:
        problems = unsupported_features(alibi_slopes, sliding_window, kv_cache_dtype,
                                        logits_soft_cap, attn_type, sinks)
        if problems:
            raise NotImplementedError(f"dartree's {self.device_name} attention does not "
                                      "support " + ", ".join(problems))
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata,
               out: torch.Tensor) -> None:
        raise NotImplementedError

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if attn_metadata is None:   # profiling / warm-up
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        self.attend(q, kv_cache, attn_metadata, out)
        return output

    def _rows(self, key, value, slot_mapping):
        n = slot_mapping.shape[0]
        return (key[:n].reshape(n, self.num_kv_heads, self.head_size),
                value[:n].reshape(n, self.num_kv_heads, self.head_size))
