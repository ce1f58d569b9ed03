"""Tree-masked paged attention (pure torch): the reference of the GPU kernel and the math of
the CPU backend, plus the KV writes and the KV compaction copy of a tree round."""

from vllm_dartree.attention.paged import (
    PagedBatch,
    copy_kv_slots,
    paged_attention_reference,
    slots_of,
    write_kv,
)

__all__ = ["PagedBatch", "copy_kv_slots", "paged_attention_reference", "slots_of", "write_kv"]
