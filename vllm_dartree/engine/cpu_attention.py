"""The CPU attention backend of dartree: vLLM's CPU_ATTN slot, with tree masks.

The stock CPU backend takes no mask and packs its KV cache in an ISA-specific layout that
Python cannot read or move, which tree verification needs (masks on the verify rows, and
compaction of the accepted nodes into chain slots). This backend keeps the tensor vLLM
allocates (`[num_blocks, num_kv_heads, block_size, 2 * head_size]`, same shape, same bytes)
but owns its interpretation: token-major, K in `[..., :head_size]`, V in `[..., head_size:]`.

Rows of request r are the last q_len positions of its sequence; row i sees every committed
position and, inside this step's window, the causal triangle (prefill chunks, decode rows,
chains) or, for a tree request (`is_tree[r]`), its row of the ancestor mask (the runner
fills `is_tree` / `tree_mask` each step, in `vllm_dartree.attention.PagedBatch`'s format).
Refused at start-up: sliding windows, ALiBi, logit softcapping, sinks, fp8 KV caches and
non-decoder attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from vllm_dartree.engine import cpu_kernel
from vllm_dartree.engine.attention import (
    TreeAttentionImplBase,
    copy_slots,
    kv_views,
    write_slots,
)
from vllm_dartree.tree.structure import bitmask_to_mask

__all__ = ["DARTreeCPUAttentionBackend", "DARTreeCPUAttentionImpl", "DARTreeCPUMetadata",
           "kv_views", "copy_slots", "tree_attention"]


@dataclass
class DARTreeCPUMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor     # [R + 1] int32
    max_seq_len: int
    seq_lens: torch.Tensor            # [R] int32, this step's rows included
    block_table: torch.Tensor         # [R, max_blocks] int32
    slot_mapping: torch.Tensor        # [T] int64, -1 = padding row
    causal: bool = True
    is_tree: list[bool] | None = None        # set by the runner for verify steps
    tree_mask: torch.Tensor | None = None    # [R, Qmax, ceil(Qmax / 32)] int32 bitmask

    def attach_trees(self, is_tree: list[bool] | None, tree_mask: torch.Tensor | None) -> None:
        """The runner's trees for this step (None: every request is causal)."""
        self.is_tree = is_tree if tree_mask is not None else None
        self.tree_mask = tree_mask if self.is_tree is not None else None
        self._plan = None


class DARTreeCPUMetadataBuilder(AttentionMetadataBuilder[DARTreeCPUMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cm = common_attn_metadata
        if not isinstance(cm.causal, bool) or not cm.causal:
            raise NotImplementedError("dartree's CPU attention runs causal decoder attention "
                                      "only")
        return DARTreeCPUMetadata(
            num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
            query_start_loc=cm.query_start_loc_cpu, max_seq_len=cm.max_seq_len,
            seq_lens=cm.seq_lens.cpu(), block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping)


# Requests with at most this many rows this step (decode rows, verify trees) are attended
# in one padded batch; longer ones (prompt chunks) one at a time.
BATCHED_MAX_ROWS = 80
# With the compiled kernel (`cpu_kernel`), requests with at most this many rows (decode rows,
# small trees: gather-bound in SDPA) are attended by it straight from the paged cache; more
# rows are compute-bound, and SDPA's blocked GEMMs do them faster. Measured here (SmolLM2
# shapes, 300 positions, fp32): 16 trees of 5 rows 2.2 ms in the kernel against 4.7 ms in
# SDPA, 9 rows about even (4.0 / 3.8 ms), 17 rows SDPA ahead (0.9 / 1.7 ms for 4 trees).
KERNEL_MAX_ROWS = 8
KERNEL_ROW_CHUNK = 16    # rows of one request per work item (parallel grain of big trees)


@dataclass
class _Plan:
    """How this step's rows are attended, built once per step and shared by all layers."""
    batched: list[int]            # requests in the padded batch
    blocks: torch.Tensor | None   # [Rb * nb] int64, their first nb = ceil(Lmax / block) blocks
    length: int                   # Lmax
    rows: torch.Tensor | None     # [Rb, Qmax] flattened query row of every padded row
    row_valid: torch.Tensor | None  # [Rb, Qmax]
    mask: torch.Tensor | None     # [Rb, 1, Qmax, Lmax] bool; None when every row sees all
    single: list[int]             # requests attended one at a time
    kernel: torch.Tensor | None = None    # [Rk] int64 requests attended by the kernel
    is_tree: torch.Tensor | None = None   # [R] uint8 for the kernel
    tree_mask: torch.Tensor | None = None  # [R, Q, words] int32 contiguous, or empty


def _window_mask(md: DARTreeCPUMetadata, r: int, q_len: int) -> torch.Tensor:
    if md.is_tree is not None and md.is_tree[r]:
        return bitmask_to_mask(md.tree_mask[r, :q_len], q_len)
    return torch.ones(q_len, q_len, dtype=torch.bool).tril()


def _plan(md: DARTreeCPUMetadata, block_size: int, use_kernel: bool) -> _Plan:
    cached = getattr(md, "_plan", None)
    if cached is not None:
        return cached
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    q_lens = [qsl[r + 1] - qsl[r] for r in range(len(seq_lens))]
    live = [r for r, q in enumerate(q_lens) if q > 0]
    kernel = [r for r in live if use_kernel and q_lens[r] <= KERNEL_MAX_ROWS]
    rest = [r for r in live if not (use_kernel and q_lens[r] <= KERNEL_MAX_ROWS)]
    batched = [r for r in rest if q_lens[r] <= BATCHED_MAX_ROWS]
    single = [r for r in rest if q_lens[r] > BATCHED_MAX_ROWS]
    plan = _Plan(batched, None, 0, None, None, None, single)
    if kernel:
        plan.kernel = torch.tensor(kernel, dtype=torch.int64)
        if md.is_tree is not None:
            plan.is_tree = torch.tensor(md.is_tree, dtype=torch.uint8)
            plan.tree_mask = md.tree_mask.to(torch.int32).contiguous()
        else:
            plan.is_tree = torch.zeros(0, dtype=torch.uint8)
            plan.tree_mask = torch.zeros(0, 0, 0, dtype=torch.int32)
    if batched:
        q_max = max(q_lens[r] for r in batched)
        l_max = max(seq_lens[r] for r in batched)
        qn = torch.tensor([q_lens[r] for r in batched])
        num_blocks = -(-l_max // block_size)
        # whole blocks: positions past a request's length hold finite values (vLLM zeroes
        # the cache; stale rows are old K/V) and are masked out below
        plan.blocks = md.block_table[torch.tensor(batched), :num_blocks].long().flatten()
        plan.length = l_max
        j = torch.arange(q_max)[None, :]
        plan.row_valid = j < qn[:, None]
        plan.rows = torch.tensor([qsl[r] for r in batched])[:, None] + torch.minimum(
            j, qn[:, None] - 1)
        mask = torch.zeros(len(batched), q_max, l_max, dtype=torch.bool)
        for i, r in enumerate(batched):
            q, length = q_lens[r], seq_lens[r]
            mask[i, :q, :length - q] = True
            mask[i, :q, length - q:length] = _window_mask(md, r, q)
            mask[i, q:, 0] = True    # padding rows: any finite softmax, discarded
        plan.mask = None if bool(mask.all()) else mask[:, None]   # e.g. one decode row
    md._plan = plan
    return plan


def tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, md: DARTreeCPUMetadata,
                   scale: float, out: torch.Tensor, kernel: bool | None = None) -> None:
    """query [T, NH, D] -> out [T, NH, D]: every row sees its context and its causal / tree
    window. Short requests go to the compiled kernel (`kernel`: default, when it loads) or
    else to one padded SDPA call; prompt chunks are attended one at a time by SDPA."""
    head_size = query.shape[-1]
    # token-major [blocks, block_size, KVH, 2D]: K and V of a slot gathered in one index
    token_major = kv_cache.permute(0, 2, 1, 3)
    block_size, kv_heads = token_major.shape[1], token_major.shape[2]
    gqa = query.shape[1] != kv_heads     # SDPA shares each K/V head across its query group
    module = cpu_kernel.load() if kernel is not False else None
    if kernel and module is None:
        raise RuntimeError("the compiled CPU tree attention is unavailable")
    plan = _plan(md, block_size, module is not None)
    if plan.kernel is not None and plan.kernel.numel():
        module.tree_attention(query, kv_cache, md.block_table, md.query_start_loc,
                              md.seq_lens, plan.kernel, plan.is_tree, plan.tree_mask,
                              float(scale), KERNEL_ROW_CHUNK, out)
    if plan.batched:
        # one contiguous copy per block (index_select), then [Rb, KVH, L, 2D]
        rb, nb = len(plan.batched), plan.blocks.shape[0] // len(plan.batched)
        kv = kv_cache.index_select(0, plan.blocks).view(rb, nb, *kv_cache.shape[1:])
        kv = kv.transpose(1, 2).reshape(rb, kv_heads, nb * block_size, -1)[:, :, :plan.length]
        q = query[plan.rows]                                             # [Rb, Q, NH, D]
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kv[..., :head_size], kv[..., head_size:],
            attn_mask=plan.mask, scale=scale, enable_gqa=gqa).transpose(1, 2)
        out[plan.rows[plan.row_valid]] = attn[plan.row_valid].to(out.dtype)
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    for r in plan.single:
        start, end, seq_len = qsl[r], qsl[r + 1], seq_lens[r]
        q_len = end - start
        positions = torch.arange(seq_len)
        blocks = md.block_table[r].long()[positions // block_size]
        offsets = positions % block_size
        kv = token_major[blocks, offsets].transpose(0, 1)                 # [KVH, L, 2D]
        tree = md.is_tree is not None and md.is_tree[r]
        if seq_len == q_len and not tree:     # a whole prompt: SDPA's causal kernel, no mask
            mask = None
        else:
            window = _window_mask(md, r, q_len)
            mask = torch.cat([window.new_ones(q_len, seq_len - q_len), window], dim=1)
        # 4-D inputs: torch's CPU flash kernel takes them (3-D ones fall back to the math
        # path, about 4x slower on a 450-token prompt)
        attn = torch.nn.functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], kv[None, ..., :head_size],
            kv[None, ..., head_size:], attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=gqa)[0]
        out[start:end] = attn.transpose(0, 1).to(out.dtype)


class DARTreeCPUAttentionImpl(TreeAttentionImplBase):
    device_name = "CPU"

    def attend(self, q, kv_cache, attn_metadata, out) -> None:
        tree_attention(q, kv_cache, attn_metadata, self.scale, out)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key, value = self._rows(key, value, slot_mapping)
        module = cpu_kernel.load()
        if module is not None and key.dtype == kv_cache.dtype:
            module.write_slots(kv_cache, key, value, slot_mapping.long())
        else:
            write_slots(kv_cache, key, value, slot_mapping)


class DARTreeCPUAttentionBackend(CPUAttentionBackend):
    """Registered over CPU_ATTN in dartree workers (a subclass, so isinstance checks hold)."""

    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_impl_cls():
        return DARTreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return DARTreeCPUMetadataBuilder
