"""`CompactionMixin`: KV compaction (stage 5 of a round).

The accepted nodes' K/V move into chain slots p0+1..p0+L before the scheduler, which
assumes a chain, sees the result: `vllm_dartree.engine.attention.copy_slots` on the GPU's
token-major layout, `vllm_dartree.engine.cpu_attention.copy_slots` on the CPU's (either
layout, `cpu_attention.kv_layout`).
"""

from __future__ import annotations

import torch

__all__ = ["CompactionMixin"]


class CompactionMixin:
    """KV compaction for `DARTreeRunnerMixin` (uses its `_dt_step` and `_dt_timed`)."""

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        super()._update_states_after_model_execute(output_token_ids, scheduler_output)
        step = self._dt_step
        if step is None or not step.accepted:
            return
        src, dst = [], []
        for i, nodes in enumerate(step.accepted):
            first = int(step.starts[i]) + 1
            for k, node in enumerate(nodes):
                if node != k:
                    src.append(first + node)
                    dst.append(first + k)
        if not src:
            return
        slot_mapping = self.input_batch.block_table.block_tables[0].slot_mapping.gpu
        src_slots = slot_mapping[torch.tensor(src)].long()
        dst_slots = slot_mapping[torch.tensor(dst)].long()
        with self._dt_timed("compaction"):
            self._dt_copy_slots(src_slots, dst_slots)

    def _dt_copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        from vllm_dartree.engine import attention
        seen = set()
        for kv in self.kv_caches:
            if kv is None or kv.data_ptr() in seen:
                continue
            seen.add(kv.data_ptr())
            if kv.device.type == "cpu":
                from vllm_dartree.engine.cpu_attention import copy_slots
            else:
                copy_slots = attention.copy_slots
            copy_slots(kv, src_slots.to(kv.device), dst_slots.to(kv.device))
