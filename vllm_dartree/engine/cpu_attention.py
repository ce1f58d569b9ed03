"""The CPU attention backend of dartree: vLLM's CPU_ATTN slot, with tree masks.

The stock CPU backend takes no mask, which tree verification needs. This backend keeps the
tensor vLLM allocates (`[num_blocks, num_kv_heads, block_size, 2 * head_size]`) in one of two
layouts (`kv_layout`):

- "vec", where vLLM's own CPU attention ops serve it (x86, block and head sizes multiples
  of 32, fp32 / bf16): vLLM's layout for its `vec` ISA (per block and KV head, K transposed
  `[head_size, block_size]`, then V `[block_size, head_size]`). Requests without a tree
  (decode rows, prompt chunks, chains) are attended by vLLM's own kernel, as fast as plain
  vLLM; trees by dartree's compiled kernel, which reads the same layout.
- "token" elsewhere: token-major, K in `[..., :head_size]`, V in `[..., head_size:]`
  (`engine.attention.kv_views`), every request through dartree's kernel or SDPA.

Rows of request r are the last q_len positions of its sequence; row i sees every committed
position and, inside this step's window, the causal triangle (prefill chunks, decode rows,
chains) or, for a tree request (`is_tree[r]`), its row of the ancestor mask (the runner
fills `is_tree` / `tree_mask` each step, in `vllm_dartree.attention.PagedBatch`'s format).
Refused at start-up: sliding windows, ALiBi, logit softcapping, sinks, fp8 KV caches and
non-decoder attention.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from vllm_dartree.engine import cpu_kernel
from vllm_dartree.engine import attention as token_layout
from vllm_dartree.engine.attention import TreeAttentionImplBase, kv_views
from vllm_dartree.tree.structure import bitmask_to_mask

__all__ = ["DARTreeCPUAttentionBackend", "DARTreeCPUAttentionImpl", "DARTreeCPUMetadata",
           "kv_layout", "kv_views", "vec_views", "copy_slots", "write_slots", "tree_attention"]

LAYOUT_ENV = "VLLM_DARTREE_CPU_KV_LAYOUT"    # "token" forces the token-major layout


# -- KV layouts ----------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _vllm_ops():
    """vLLM's CPU attention ops (`vllm._custom_ops`), or None where this build lacks them."""
    try:
        import vllm._custom_ops as ops
        for name in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache",
                     "get_scheduler_metadata"):
            getattr(torch.ops._C, name)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ops


def kv_layout(kv_cache: torch.Tensor) -> str:
    """"vec" where vLLM's CPU attention ops serve this KV tensor (its `vec` ISA layout: x86,
    block size and head size multiples of 32, fp32 or bf16), else "token". A function of the
    tensor and the environment, so the attention and the KV compaction always agree. The
    GPU backend's impl on CPU (`VLLM_DARTREE_CPU_ATTENTION=paged`, for tests) is token-major."""
    if (os.environ.get(LAYOUT_ENV, "vec") == "token"
            or os.environ.get("VLLM_DARTREE_CPU_ATTENTION") == "paged"):
        return "token"
    return _layout(kv_cache.shape[2], kv_cache.shape[3] // 2, kv_cache.dtype)


@lru_cache(maxsize=None)
def _layout(block_size: int, head_size: int, dtype: torch.dtype) -> str:
    if (platform.machine() in ("x86_64", "AMD64") and block_size % 32 == 0
            and head_size % 32 == 0 and dtype in (torch.float32, torch.bfloat16)
            and _vllm_ops() is not None):
        return "vec"
    return "token"


def vec_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The vec layout's K, transposed, [num_blocks, KVH, head_size, block_size] and V
    [num_blocks, KVH, block_size, head_size] (views of vLLM's tensor)."""
    num_blocks, kv_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    flat = kv_cache.view(num_blocks, kv_heads, block_size * two_d)
    return (flat[..., :block_size * d].view(num_blocks, kv_heads, d, block_size),
            flat[..., block_size * d:].view(num_blocks, kv_heads, block_size, d))


def _vllm_halves(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """key_cache / value_cache as vLLM's CPU backend passes them to its ops."""
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)


def write_slots(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slots: torch.Tensor) -> None:
    """Store key/value [T, KVH, D] at slots [T] in this tensor's layout (slot -1: skipped)."""
    if kv_layout(kv_cache) == "vec":
        key_cache, value_cache = _vllm_halves(kv_cache)
        _vllm_ops().cpu_attn_reshape_and_cache(key.to(kv_cache.dtype),
                                               value.to(kv_cache.dtype), key_cache,
                                               value_cache, slots.long(), "vec")
        return
    module = cpu_kernel.load()
    if module is not None and key.dtype == kv_cache.dtype:
        module.write_slots(kv_cache, key, value, slots.long())
    else:
        token_layout.write_slots(kv_cache, key, value, slots)


def copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """KV compaction on one layer in this tensor's layout: slot src[i] -> slot dst[i] (all
    reads before writes)."""
    if kv_layout(kv_cache) != "vec":
        token_layout.copy_slots(kv_cache, src, dst)
        return
    block_size = kv_cache.shape[2]
    sb, so = torch.div(src, block_size, rounding_mode="floor"), src % block_size
    db, do = torch.div(dst, block_size, rounding_mode="floor"), dst % block_size
    k_t, v = vec_views(kv_cache)
    k_t[db, :, :, do] = k_t[sb, :, :, so].clone()
    v[db, :, do] = v[sb, :, so].clone()


def _gather_kv(kv_cache: torch.Tensor, layout: str,
               blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of whole blocks [R, nb] (int64) as [R, KVH, nb * block_size, D] each."""
    rb, nb = blocks.shape
    num_blocks, kv_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    if layout == "vec":
        k_t, v = vec_views(kv_cache)
        k = k_t.index_select(0, blocks.flatten()).view(rb, nb, kv_heads, d, block_size)
        v = v.index_select(0, blocks.flatten()).view(rb, nb, kv_heads, block_size, d)
        return (k.permute(0, 2, 1, 4, 3).reshape(rb, kv_heads, nb * block_size, d),
                v.transpose(1, 2).reshape(rb, kv_heads, nb * block_size, d))
    # one contiguous copy per block (index_select), then [Rb, KVH, L, 2D]
    kv = kv_cache.index_select(0, blocks.flatten()).view(rb, nb, *kv_cache.shape[1:])
    kv = kv.transpose(1, 2).reshape(rb, kv_heads, nb * block_size, two_d)
    return kv[..., :d], kv[..., d:]


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
# With the compiled kernel (`cpu_kernel`) on the token layout, requests with at most this
# many rows (decode rows, small trees: gather-bound in SDPA) are attended by it straight from
# the paged cache; more rows are compute-bound, and SDPA's blocked GEMMs do them faster.
# Measured here (SmolLM2 shapes, 300 positions, fp32): 16 trees of 5 rows 2.2 ms in the
# kernel against 4.7 ms in SDPA, 9 rows about even (4.0 / 3.8 ms), 17 rows SDPA ahead
# (0.9 / 1.7 ms for 4 trees). On the vec layout the kernel's scores are vector FMAs over
# runs of positions and it keeps trees to 12 rows (30 layers, 300 positions: 9 rows x 16
# trees 51 ms against 70 ms through SDPA; 17 rows x 4 trees 27 ms against 21 ms).
# Built for AVX-512 (16-lane FMAs: twice the AVX2 build's speed) and with its query rows
# blocked four at a time (each K / V vector loaded feeds four rows' independent FMA chains),
# the vec kernel stays ahead of SDPA past the largest tree (a Xeon here, 500 positions, one
# layer: one tree of 13 rows 216 us against 771 through vLLM's causal kernel, 33 rows 538
# against 736 us through SDPA, 65 rows 1,057 against 1,125; four trees of 33 rows 2.2
# against 2.8 ms, of 65 rows 4.5 against 4.7): every tree goes to it.
KERNEL_MAX_ROWS = 8
VEC_KERNEL_MAX_ROWS = 12
VEC_KERNEL_MAX_ROWS_AVX512 = 72
KERNEL_ROW_CHUNK = 16    # rows of one request per work item (parallel grain of big trees)


@dataclass
class _VllmCall:
    """The causal requests of a step on the vec layout, for vLLM's own kernel."""
    rows: torch.Tensor | None       # their query rows (None: every row of the step)
    query_start_loc: torch.Tensor   # [Rc + 1] int32
    seq_lens: torch.Tensor          # [Rc] int32
    block_table: torch.Tensor       # [Rc, max_blocks] int32
    scheduler: dict = field(default_factory=dict)   # (heads, kv heads, D, dtype) -> metadata


@dataclass
class _Plan:
    """How this step's rows are attended, built once per step and shared by all layers."""
    batched: list[int]            # requests in the padded batch
    blocks: torch.Tensor | None   # [Rb, nb] int64, their first nb = ceil(Lmax / block) blocks
    length: int                   # Lmax
    rows: torch.Tensor | None     # [Rb, Qmax] flattened query row of every padded row
    row_valid: torch.Tensor | None  # [Rb, Qmax]
    mask: torch.Tensor | None     # [Rb, 1, Qmax, Lmax] bool; None when every row sees all
    single: list[int]             # requests attended one at a time
    kernel: torch.Tensor | None = None    # [Rk] int64 requests attended by the kernel
    is_tree: torch.Tensor | None = None   # [R] uint8 for the kernel
    tree_mask: torch.Tensor | None = None  # [R, Q, words] int32 contiguous, or empty
    vllm: _VllmCall | None = None         # causal requests for vLLM's kernel (vec layout)


def _window_mask(md: DARTreeCPUMetadata, r: int, q_len: int) -> torch.Tensor:
    if md.is_tree is not None and md.is_tree[r]:
        return bitmask_to_mask(md.tree_mask[r, :q_len], q_len)
    return torch.ones(q_len, q_len, dtype=torch.bool).tril()


def _vllm_call(md: DARTreeCPUMetadata, causal: list[int], q_lens: list[int],
               everyone: bool) -> _VllmCall:
    if everyone:     # no tree this step: vLLM's kernel takes the step as it is
        return _VllmCall(None, md.query_start_loc, md.seq_lens, md.block_table)
    qsl = md.query_start_loc.tolist()
    rows = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in causal])
    sub = torch.tensor([0] + [q_lens[r] for r in causal], dtype=torch.int32).cumsum(0)
    index = torch.tensor(causal)
    return _VllmCall(rows, sub.to(torch.int32), md.seq_lens[index].contiguous(),
                     md.block_table[index].contiguous())


def _plan(md: DARTreeCPUMetadata, block_size: int, use_kernel: bool, layout: str) -> _Plan:
    cached = getattr(md, "_plan", None)
    if cached is not None:
        return cached
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    q_lens = [qsl[r + 1] - qsl[r] for r in range(len(seq_lens))]
    live = [r for r, q in enumerate(q_lens) if q > 0]
    vllm_call = None
    max_rows = KERNEL_MAX_ROWS
    avx512 = use_kernel and cpu_kernel.isa() == "avx512"
    if layout == "vec":
        max_rows = VEC_KERNEL_MAX_ROWS_AVX512 if avx512 else VEC_KERNEL_MAX_ROWS
        # requests without a tree: vLLM's kernel; in a step with trees, on an AVX-512
        # build, the decode rows and chains that fit the kernel go with the trees to it
        causal = [r for r in live if md.is_tree is None or not md.is_tree[r]]
        if avx512 and md.is_tree is not None:
            causal = [r for r in causal if q_lens[r] > max_rows]
        if causal:
            vllm_call = _vllm_call(md, causal, q_lens, len(causal) == len(live))
        vllm_rows = set(causal)
        live = [r for r in live if r not in vllm_rows]
    kernel = [r for r in live if use_kernel and q_lens[r] <= max_rows]
    rest = [r for r in live if not (use_kernel and q_lens[r] <= max_rows)]
    batched = [r for r in rest if q_lens[r] <= BATCHED_MAX_ROWS]
    single = [r for r in rest if q_lens[r] > BATCHED_MAX_ROWS]
    plan = _Plan(batched, None, 0, None, None, None, single, vllm=vllm_call)
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
        plan.blocks = md.block_table[torch.tensor(batched), :num_blocks].long()
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


def _attend_with_vllm(call: _VllmCall, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """vLLM's kernel on `call`'s requests; key_cache / value_cache: `_vllm_halves`."""
    ops = _vllm_ops()
    num_heads, head_size = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[1]
    key = (num_heads, kv_heads, head_size, query.dtype)
    if key not in call.scheduler:
        import vllm.envs as envs
        call.scheduler[key] = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=call.seq_lens.shape[0], num_heads=num_heads, num_kv_heads=kv_heads,
            head_dim=head_size, seq_lens=call.seq_lens, dtype=query.dtype,
            query_start_loc=call.query_start_loc, causal=True, sliding_window_size=-1,
            isa="vec", enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    q = query if call.rows is None else query[call.rows]
    o = out if call.rows is None else torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=o,
        query_start_loc=call.query_start_loc, seq_lens=call.seq_lens, scale=scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=call.block_table,
        softcap=0.0, scheduler_metadata=call.scheduler[key], s_aux=None)
    if call.rows is not None:
        out[call.rows] = o


def tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, md: DARTreeCPUMetadata,
                   scale: float, out: torch.Tensor, kernel: bool | None = None,
                   layout: str | None = None) -> None:
    """query [T, NH, D] -> out [T, NH, D]: every row sees its context and its causal / tree
    window. On the vec layout, requests without a tree go to vLLM's kernel; the others go to
    the compiled kernel (`kernel`: default, when it loads; False: the SDPA path) or else to
    one padded SDPA call, prompt chunks one at a time through SDPA. `layout`: the tensor's
    (`kv_layout`) unless given."""
    head_size = query.shape[-1]
    layout = layout or kv_layout(kv_cache)
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[1]
    gqa = query.shape[1] != kv_heads     # SDPA shares each K/V head across its query group
    module = cpu_kernel.load() if kernel is not False else None
    if kernel and module is None:
        raise RuntimeError("the compiled CPU tree attention is unavailable")
    plan = _plan(md, block_size, module is not None, layout)
    if plan.vllm is not None:
        _attend_with_vllm(plan.vllm, query, *_vllm_halves(kv_cache), scale, out)
    if plan.kernel is not None and plan.kernel.numel():
        module.tree_attention(query, kv_cache, md.block_table, md.query_start_loc,
                              md.seq_lens, plan.kernel, plan.is_tree, plan.tree_mask,
                              float(scale), KERNEL_ROW_CHUNK, layout == "vec", out)
    if plan.batched:
        k, v = _gather_kv(kv_cache, layout, plan.blocks)     # [Rb, KVH, nb * block, D]
        q = query[plan.rows]                                 # [Rb, Q, NH, D]
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k[:, :, :plan.length], v[:, :, :plan.length],
            attn_mask=plan.mask, scale=scale, enable_gqa=gqa).transpose(1, 2)
        out[plan.rows[plan.row_valid]] = attn[plan.row_valid].to(out.dtype)
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    for r in plan.single:
        start, end, seq_len = qsl[r], qsl[r + 1], seq_lens[r]
        q_len = end - start
        blocks = md.block_table[r, :-(-seq_len // block_size)].long()[None]
        k, v = _gather_kv(kv_cache, layout, blocks)                     # [1, KVH, L+, D]
        tree = md.is_tree is not None and md.is_tree[r]
        if seq_len == q_len and not tree:     # a whole prompt: SDPA's causal kernel, no mask
            mask = None
        else:
            window = _window_mask(md, r, q_len)
            mask = torch.cat([window.new_ones(q_len, seq_len - q_len), window], dim=1)
        # 4-D inputs: torch's CPU flash kernel takes them (3-D ones fall back to the math
        # path, about 4x slower on a 450-token prompt)
        attn = torch.nn.functional.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None], k[:, :, :seq_len], v[:, :, :seq_len],
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)[0]
        out[start:end] = attn.transpose(0, 1).to(out.dtype)


class DARTreeCPUAttentionImpl(TreeAttentionImplBase):
    """On the vec layout, a step without trees (and every KV write) goes straight to vLLM's
    ops, with this layer's K/V views made once: the general path's Python (layout checks,
    views, casts) cost about 2.6 ms of a 60 ms one-request step over SmolLM2's 30 layers
    (measured against stock vLLM's CPU backend); a step with trees takes `tree_attention`."""

    device_name = "CPU"
    _views: tuple | None = None   # (kv_cache, its layout, vLLM's key / value halves)

    def _kv(self, kv_cache: torch.Tensor) -> tuple:
        views = self._views
        if views is None or views[0] is not kv_cache:
            layout = kv_layout(kv_cache)
            halves = _vllm_halves(kv_cache) if layout == "vec" else (None, None)
            views = self._views = (kv_cache, layout, *halves)
        return views

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        md = attn_metadata
        if (md is not None and md.is_tree is None and output_scale is None
                and output_block_scale is None and query.dim() == 3):
            _, layout, key_cache, value_cache = self._kv(kv_cache)
            if layout == "vec":   # no tree this step: vLLM's kernel takes it as it is
                n = md.num_actual_tokens
                plan = _plan(md, kv_cache.shape[2], False, layout)
                if plan.vllm is not None:
                    _attend_with_vllm(plan.vllm, query[:n], key_cache, value_cache,
                                      self.scale, output[:n])
                return output
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale, output_block_scale)

    def attend(self, q, kv_cache, attn_metadata, out) -> None:
        tree_attention(q, kv_cache, attn_metadata, self.scale, out)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        _, layout, key_cache, value_cache = self._kv(kv_cache)
        n = slot_mapping.shape[0]
        if (layout == "vec" and key.dim() == 3 and key.dtype == kv_cache.dtype
                and value.dtype == kv_cache.dtype and slot_mapping.dtype == torch.int64):
            if key.shape[0] != n:
                key, value = key[:n], value[:n]
            _vllm_ops().cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                                   slot_mapping, "vec")
            return
        key, value = self._rows(key, value, slot_mapping)
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
