"""The GPU attention backend of dartree: paged Triton attention with per-request tree masks.

vLLM's FlashAttention takes no mask and its Triton unified kernel has one query-query bias for
the whole batch; tree verification needs a different ancestor mask for every request. This
backend runs `csrc_triton.tree_attention` (through `vllm_dartree.ops`) over vLLM's own paged
KV tensor, read exactly as the CPU backend reads it (`engine.attention.kv_views`), in one
launch per layer for a mixed batch: prefill chunks and decode rows (causal) and verify trees
(`[root] + nodes`, each row sees the committed context, its ancestors and itself).

It is registered as vLLM's CUSTOM backend by the dartree GPU worker (and selected by the
plugin: `attention_backend="CUSTOM"`), so it is used only when a dartree config is active.
The metadata stays on the device; the runner attaches each step's trees
(`attach_trees(is_tree, tree_mask)`, the mask built on the device by `ops.ancestor_bitmask`)
after vLLM's builder ran. Steps without trees use persistent all-causal buffers.

CUDA graphs: the builder declares no full-graph support, so vLLM runs the target with
piecewise graphs (attention, between the pieces, runs eagerly with this step's shapes).
Refused at start-up, as on CPU: sliding windows, ALiBi, softcapping, sinks, fp8 KV caches,
non-decoder attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, AttentionType

from vllm_dartree import ops
from vllm_dartree.attention.paged import PagedBatch
from vllm_dartree.engine.attention import TreeAttentionImplBase, kv_views, write_slots

__all__ = ["DARTreeGPUAttentionBackend", "DARTreeGPUAttentionImpl", "DARTreeGPUMetadata",
           "DARTreeGPUMetadataBuilder"]


@dataclass
class DARTreeGPUMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor     # [R + 1] int32, device
    max_seq_len: int
    seq_lens: torch.Tensor            # [R] int32, this step's rows included, device
    block_table: torch.Tensor         # [R, max_blocks] int32, device
    slot_mapping: torch.Tensor        # [T] int64, -1 = padding row, device
    is_tree: torch.Tensor             # [R] int8, device (zeros: every request causal)
    tree_mask: torch.Tensor           # [R, Qmax, words] int32, device (read on tree rows only)

    def attach_trees(self, is_tree: list[bool] | None, tree_mask: torch.Tensor | None) -> None:
        """The runner's trees for this step (None: every request is causal)."""
        if is_tree is None or tree_mask is None:
            return
        flags = torch.tensor(is_tree, dtype=torch.int8)
        self.is_tree = flags.to(self.seq_lens.device, non_blocking=True)
        self.tree_mask = tree_mask.to(self.seq_lens.device)

    def paged_batch(self) -> PagedBatch:
        return PagedBatch(self.query_start_loc, self.seq_lens, self.block_table, self.is_tree,
                          self.tree_mask)


class DARTreeGPUMetadataBuilder(AttentionMetadataBuilder[DARTreeGPUMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        max_reqs = vllm_config.scheduler_config.max_num_seqs
        # Persistent "no tree" inputs: a causal step allocates nothing.
        self._causal = torch.zeros(max_reqs, dtype=torch.int8, device=device)
        self._no_mask = torch.zeros(max_reqs, 1, 1, dtype=torch.int32, device=device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        if not isinstance(cm.causal, bool) or not cm.causal:
            raise NotImplementedError("dartree's GPU attention runs causal decoder attention "
                                      "only")
        num_reqs = cm.num_reqs
        if num_reqs > self._causal.shape[0]:   # never in vLLM (max_num_seqs bounds it)
            self._causal = torch.zeros(num_reqs, dtype=torch.int8, device=self.device)
            self._no_mask = torch.zeros(num_reqs, 1, 1, dtype=torch.int32, device=self.device)
        return DARTreeGPUMetadata(
            num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc, max_seq_len=cm.max_seq_len,
            seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping, is_tree=self._causal[:num_reqs],
            tree_mask=self._no_mask[:num_reqs])


class DARTreeGPUAttentionImpl(TreeAttentionImplBase):
    device_name = "GPU"

    def attend(self, q, kv_cache, attn_metadata, out) -> None:
        k_cache, v_cache = kv_views(kv_cache, self.head_size)
        ops.paged_attention(q, k_cache, v_cache, attn_metadata.paged_batch(), self.scale,
                            attn_metadata.max_query_len, out=out,
                            max_seq_len=attn_metadata.max_seq_len)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key, value = self._rows(key, value, slot_mapping)
        if ops.use_triton(kv_cache):   # vLLM's own cache write: skips -1 slots on the device
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
                triton_reshape_and_cache_flash,
            )
            k_cache, v_cache = kv_views(kv_cache, self.head_size)
            triton_reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping,
                                           self.kv_cache_dtype, layer._k_scale, layer._v_scale)
            return
        write_slots(kv_cache, key, value, slot_mapping)


class DARTreeGPUAttentionBackend(AttentionBackend):
    """vLLM's CUSTOM backend while dartree runs on CUDA."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return DARTreeGPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return DARTreeGPUMetadataBuilder

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # the kernel holds one head in registers: a power of two, 32 .. 256
        return 32 <= head_size <= 256 and head_size & (head_size - 1) == 0

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True   # Triton
