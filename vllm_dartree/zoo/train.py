"""Train a Domino-format drafter (DFlash backbone + GRU correction head, jointly) on a
frozen target's features: the published recipe (SpecForge), scaled down for a CPU.

Data: sequences of the target's own tokens (prompt + its regenerated response) with the
target's hidden states of the drafter's `target_layer_ids` (`FeatureShard`s). A step picks
random anchors in each sequence; every anchor a gives the teacher-forced block
`[x_a, MASK, ...]` (`DFlashBackbone.anchored_forward`, equal to inference) whose slot k
predicts x_{a+k} (shift_label: every slot predicts). The GRU head eats the ground-truth
tokens x_a, x_{a+1}, ... along the block. Loss per depth k, weighted by exp(-(k-1)/gamma):

    (1 - lambda) * CE(base_k + correction_k) + lambda * CE(base_k)

with lambda decayed linearly from `lambda_start` to `lambda_end` (depth 1 is uncorrected:
pure_draft_prefix_len 1). Checkpoints (model, optimiser, step, RNG) are written atomically
every `checkpoint_every` steps and a run resumes from the last one, so it can be cut off at
any point. `export` writes the Domino checkpoint folder that `load_drafter` reads.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_dartree.drafter import DFlashBackbone, DominoGRUHead, DrafterSpec
from vllm_dartree.drafter.layers import linear

__all__ = ["TrainConfig", "FeatureShard", "DrafterTrainer", "domino_loss", "export_domino"]


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    sequences_per_step: int = 4
    anchors_per_sequence: int = 32
    lr: float = 6e-4
    warmup_steps: int = 50
    weight_decay: float = 0.0
    gamma: float = 7.0
    lambda_start: float = 1.0
    lambda_end: float = 0.1
    checkpoint_every: int = 50
    seed: int = 0

    def lam(self, step: int) -> float:
        frac = min(1.0, step / max(1, self.steps))
        return self.lambda_start + (self.lambda_end - self.lambda_start) * frac

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


@dataclass
class FeatureShard:
    tokens: torch.Tensor     # [T] int64
    features: torch.Tensor   # [T, n*H] the target's features of every token


def domino_loss(backbone: DFlashBackbone, head: DominoGRUHead, shard: FeatureShard,
                anchors: torch.Tensor, gamma: float, lam: float):
    """Loss and statistics of one sequence's anchored blocks.

    Returns (loss, stats) with stats = {"tokens": valid labels, "accepted": the summed
    teacher-forced acceptance length (leading depths whose corrected argmax is right)}.
    """
    spec = backbone.spec
    tokens, depths = shard.tokens, spec.num_depths
    hidden = backbone.anchored_forward(shard.features, tokens, anchors)       # [A, D, H]
    d = torch.arange(1, depths + 1)
    target_pos = anchors[:, None] + d[None, :]                                 # x_{a+k}
    valid = target_pos < tokens.shape[0]
    labels = torch.where(valid, tokens[target_pos.clamp(max=tokens.shape[0] - 1)], -100)
    base = linear(hidden, backbone.lm_head_weight.to(hidden.dtype))           # [A, D, V]
    # Teacher-forced GRU states: after the root, then after each ground-truth token.
    state = head.init(tokens[anchors])[:, 0]                                   # [A, G]
    corrections = []
    for k in range(depths):
        if k >= head.num_uncorrected:
            corrections.append(head.correction(hidden[:, k], state))
        else:
            corrections.append(torch.zeros_like(base[:, k]))
        state = head.gru_step(state, labels[:, k].clamp(min=0))
    final = base + torch.stack(corrections, dim=1)
    weights = torch.exp(-(d.float() - 1) / gamma)[None, :].expand_as(labels)
    ce = torch.nn.functional.cross_entropy
    flat = labels.reshape(-1)
    ce_final = ce(final.reshape(-1, final.shape[-1]).float(), flat, reduction="none")
    ce_base = ce(base.reshape(-1, base.shape[-1]).float(), flat, reduction="none")
    w = (weights * valid).reshape(-1)
    loss = (((1 - lam) * ce_final + lam * ce_base) * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        right = (final.argmax(-1) == labels) & valid
        accepted = torch.cumprod(right.long(), dim=1).sum()
    return loss, {"tokens": int(valid.sum()), "accepted": int(accepted),
                  "anchors": int(anchors.shape[0])}


class DrafterTrainer:
    """Owns the model, the optimiser and the checkpoints of one training run."""

    def __init__(self, spec: DrafterSpec, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, config: TrainConfig, workdir: str | Path,
                 gru_hidden: int = 256, emb_dim: int = 64):
        torch.manual_seed(config.seed)
        self.spec, self.config, self.workdir = spec, config, Path(workdir)
        self.backbone = DFlashBackbone(spec, embed_weight.float(), lm_head_weight.float())
        self.head = DominoGRUHead(spec.hidden_size, gru_hidden, emb_dim, spec.vocab_size,
                                  embed_weight.float(), num_uncorrected=1)
        self._init_weights()
        params = [p for m in (self.backbone, self.head) for p in m.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr,
                                           weight_decay=config.weight_decay)
        self.step = 0
        self.history: list[dict] = []
        self.generator = torch.Generator().manual_seed(config.seed)
        self._resume()

    def _init_weights(self) -> None:
        for name, p in [*self.backbone.named_parameters(), *self.head.named_parameters()]:
            if name.endswith("norm.weight"):
                torch.nn.init.ones_(p)
            else:
                torch.nn.init.normal_(p, std=0.02)

    # -- checkpoints -----------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> Path:
        return self.workdir / "checkpoint.pt"

    def state(self) -> dict:
        return {"step": self.step, "backbone": self.backbone.state_dict(),
                "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(), "history": self.history,
                "config": asdict(self.config)}

    def save(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, self.checkpoint_path)

    def _resume(self) -> None:
        if not self.checkpoint_path.exists():
            return
        state = torch.load(self.checkpoint_path, weights_only=False)
        self.backbone.load_state_dict(state["backbone"], strict=False)
        self.head.load_state_dict(state["head"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step, self.history = state["step"], state["history"]

    # -- training --------------------------------------------------------------------------
    def _anchors(self, length: int) -> torch.Tensor:
        usable = max(1, length - 1)
        count = min(self.config.anchors_per_sequence, usable)
        return torch.randperm(usable, generator=self.generator)[:count].sort().values

    def train_step(self, shards: list[FeatureShard]) -> dict:
        cfg = self.config
        picks = torch.randint(len(shards), (cfg.sequences_per_step,), generator=self.generator)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(self.step)
        self.optimizer.zero_grad()
        total, stats = 0.0, {"tokens": 0, "accepted": 0, "anchors": 0}
        for i in picks.tolist():
            shard = shards[i]
            loss, s = domino_loss(self.backbone, self.head, shard,
                                  self._anchors(shard.tokens.shape[0]), cfg.gamma,
                                  cfg.lam(self.step))
            (loss / len(picks)).backward()
            total += float(loss.detach()) / len(picks)
            stats = {k: stats[k] + s[k] for k in stats}
        torch.nn.utils.clip_grad_norm_(
            [p for m in (self.backbone, self.head) for p in m.parameters()], 1.0)
        self.optimizer.step()
        self.step += 1
        record = {"step": self.step, "loss": total,
                  "tf_accept": stats["accepted"] / max(1, stats["anchors"])}
        self.history.append(record)
        if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
            self.save()
        return record

    @torch.no_grad()
    def evaluate(self, shards: list[FeatureShard]) -> float:
        """Mean teacher-forced acceptance length per anchor on held-out sequences."""
        accepted = anchors = 0
        for shard in shards:
            length = shard.tokens.shape[0]
            a = torch.arange(0, max(1, length - 1), max(1, (length - 1) // 16))
            _, s = domino_loss(self.backbone, self.head, shard, a, self.config.gamma, 0.0)
            accepted, anchors = accepted + s["accepted"], anchors + s["anchors"]
        return accepted / max(1, anchors)


def export_domino(trainer: DrafterTrainer, folder: str | Path, num_target_layers: int,
                  dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the Domino checkpoint folder (config.json + model.safetensors)."""
    spec, head = trainer.spec, trainer.head
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous()
               for k, v in [*trainer.backbone.named_parameters(), *head.named_parameters()]}
    config = {
        "architectures": ["DominoDraftModel"], "model_type": "qwen3",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "vocab_size": spec.vocab_size, "block_size": spec.query_len,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": spec.mask_token_id,
                          "target_layer_ids": list(spec.target_layer_ids),
                          "projector_type": "domino", "emb_dim": head.embed_proj[0].out_features,
                          "gru_hidden_dim": head.gru_hidden_size, "pure_draft_prefix_len": 1,
                          "shift_label": True},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
