"""The `custom_class` carrier vLLM instantiates in every worker: it loads the drafter.

vLLM builds `DARTreeProposer(vllm_config)` in the runner's `__init__` and calls
`load_model(target)` once the target is loaded (required on CPU). Drafting itself is done by
the dartree runner (`vllm_dartree.engine.runner`), which needs the target's hidden states
that vLLM's `propose(...)` call does not pass; `propose` therefore refuses to run.
"""

from __future__ import annotations

import importlib

import torch

from vllm_dartree.engine.drafters import CheckpointTreeDrafter, TreeDrafter
from vllm_dartree.engine.settings import EngineSettings

__all__ = ["DARTreeProposer", "FollowerDrafter", "target_weights", "drafter_dtype"]


def drafter_dtype(setting: str, model_dtype: torch.dtype, device: torch.device | str,
                  cpu_flags: set[str] | None = None) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes the drafter runs in (`DARTreeConfig.drafter_dtype`): its backbone's and its
    correction head's. `model` and, except on a CPU with AMX, `auto` give the target's to
    both; `auto` on such a CPU runs the backbone in bfloat16 (its matrix units: the SmolLM2
    drafter's 8 linear layers of 16 rows 0.7 against 2.2 ms in fp32 on one core of a Xeon
    here; without AMX bf16 products of few rows are slower than fp32) and keeps the head in
    the target's dtype (its per-depth steps of a few rows, gates and top-k gained nothing in
    bf16: a round at one request, 6 depths, 7.0 ms fp32, 5.9 all bf16, 5.5 this way). An
    explicit dtype is both's. `cpu_flags`: this CPU's (/proc/cpuinfo) unless given."""
    if setting == "model":
        return model_dtype, model_dtype
    if setting != "auto":
        return getattr(torch, setting), getattr(torch, setting)
    if torch.device(device).type != "cpu":
        return model_dtype, model_dtype
    if cpu_flags is None:
        from vllm_dartree.engine import cpu_kernel
        cpu_flags = cpu_kernel.cpu_flags()
    amx = {"amx_bf16", "amx_tile"} <= cpu_flags
    return (torch.bfloat16 if amx else model_dtype), model_dtype


def _tp_size() -> int:
    from vllm.distributed import parallel_state
    if not parallel_state.model_parallel_is_initialized():   # a model built outside vLLM
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def _is_tp_leader() -> bool:
    """Rank 0 of the tensor-parallel group drafts; the other ranks receive its trees."""
    if _tp_size() == 1:
        return True
    from vllm.distributed import get_tensor_model_parallel_rank
    return get_tensor_model_parallel_rank() == 0


class FollowerDrafter:
    """What a tensor-parallel rank other than 0 holds: no drafter, no per-request context.
    Rank 0 drafts and broadcasts each round's trees (`DraftingMixin`), so every rank builds
    the same masks and accepts the same nodes; the others only need the drafter's shape."""

    live_requests = 0

    def __init__(self, layer_ids, num_depths: int):
        self.layer_ids, self.num_depths = tuple(layer_ids), int(num_depths)

    def length(self, rid) -> int:
        return 0

    def trim(self, rid, length: int) -> None:
        pass

    def free(self, rid) -> None:
        pass

    def extend(self, rids, tokens, features) -> None:
        raise RuntimeError("a follower rank does not draft")

    def draft(self, rids, roots, num_depths=None):
        raise RuntimeError("a follower rank does not draft")


def target_weights(target: torch.nn.Module, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head [V, H] (vLLM pads the vocabulary rows)."""
    inner = getattr(target, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        embed = inner.embed_tokens.weight
    elif hasattr(target, "get_input_embeddings"):
        embed = target.get_input_embeddings().weight
    else:
        raise NotImplementedError(f"{type(target).__name__}: cannot find the input embedding "
                                  "that the drafter shares with the target")
    lm_head = getattr(target, "lm_head", None)
    head = embed if lm_head is None or not hasattr(lm_head, "weight") else lm_head.weight
    tied = head is embed
    embed = _full_vocab(embed, vocab_size)
    head = embed if tied else _full_vocab(head, vocab_size)
    return embed[:vocab_size], head[:vocab_size]


def _full_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Under tensor parallelism each rank holds a contiguous shard of the padded vocabulary
    rows (vLLM's VocabParallelEmbedding / ParallelLMHead): gather them (a collective, so
    every rank calls it). Unsharded: the weight itself."""
    if _tp_size() == 1 or weight.shape[0] >= vocab_size:   # the same answer on every rank
        return weight
    from vllm.distributed import tensor_model_parallel_all_gather
    return tensor_model_parallel_all_gather(weight.contiguous(), dim=0)


class DARTreeProposer:
    def __init__(self, vllm_config):
        self.settings = EngineSettings.from_vllm_config(vllm_config)
        self.vllm_config = vllm_config
        self.tree_drafter: TreeDrafter | None = None

    def load_model(self, target: torch.nn.Module) -> None:
        text = self.vllm_config.model_config.hf_text_config
        settings = self.settings
        if settings.drafter_class is not None:   # built on every rank; rank 0 drafts
            module, _, name = settings.drafter_class.rpartition(".")
            factory = getattr(importlib.import_module(module), name)
            self.tree_drafter = factory(settings.config, settings.drafter, text.vocab_size)
            return
        from vllm_dartree.drafter import TargetInfo, load_drafter
        info = TargetInfo(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                          num_hidden_layers=text.num_hidden_layers)
        embed, head = target_weights(target, text.vocab_size)   # every rank: a collective
        if not _is_tp_leader():
            from vllm_dartree.drafter.checkpoint import check_drafter_folder
            spec = check_drafter_folder(settings.drafter, info)
            self.tree_drafter = FollowerDrafter(spec.target_layer_ids,
                                                settings.config.num_depths(spec.num_depths))
            return
        dtype, head_dtype = drafter_dtype(settings.config.drafter_dtype,
                                          self.vllm_config.model_config.dtype, embed.device)
        drafter = load_drafter(settings.drafter, info, embed, head, dtype=dtype,
                               head_dtype=head_dtype)
        self.tree_drafter = CheckpointTreeDrafter(
            settings.config, drafter,
            cuda_graphs=not self.vllm_config.model_config.enforce_eager,
            max_batch=self.vllm_config.scheduler_config.max_num_seqs)

    def propose(self, *args, **kwargs):
        raise RuntimeError("DARTreeProposer.propose was called: the dartree runner is not "
                           "installed (start vLLM with speculative_config={'method': 'dartree', "
                           "...}, which selects the dartree worker)")
