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

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_dartree.drafter import DFlashBackbone, DominoGRUHead, DrafterSpec
from vllm_dartree.drafter.checkpoint import DRAFT_VOCAB_KEY
from vllm_dartree.zoo.features import SOURCES, FeatureShard, load_shards

__all__ = ["TrainConfig", "FeatureShard", "DrafterTrainer", "domino_loss", "export_domino",
           "held_out_acceptance", "spec_for_target", "main"]


EARLY_WINDOW = 48   # bench.tau's default --max-new-tokens: where the tau table drafts


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
    schedule: str = "cosine"   # or "constant" (after the warm-up)
    bf16: bool = False    # matrix products in bfloat16 (CPU autocast; AMX makes them ~3x faster)

    def lam(self, step: int) -> float:
        frac = min(1.0, step / max(1, self.steps))
        return self.lambda_start + (self.lambda_end - self.lambda_start) * frac

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        frac = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


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
    # The labels' logit columns: -1 outside a reduced draft vocabulary (never proposed, so
    # not trained; counted as misses by the acceptance statistics).
    columns = backbone.draft_columns(labels)
    # One large product each (contiguous [A*D, V] logits; under bf16 autocast on AMX).
    base = torch.nn.functional.linear(hidden, backbone.output_weight.to(hidden.dtype))
    # Teacher-forced GRU states: S_0 after the root, S_k after the ground-truth x_{a+1..a+k};
    # depth k >= num_uncorrected is corrected from (z_k, S_k), all depths in one call.
    skip = head.num_uncorrected
    states = [head.init(tokens[anchors])[:, 0]]                                # [A, G]
    for k in range(depths - 1):
        states.append(head.gru_step(states[-1], labels[:, k].clamp(min=0)))
    corrections = head.correction(hidden[:, skip:], torch.stack(states[skip:], dim=1))
    final = torch.cat([base[:, :skip], base[:, skip:] + corrections.to(base.dtype)], dim=1)
    weights = torch.exp(-(d.float() - 1) / gamma)[None, :].expand_as(labels)
    ce = torch.nn.functional.cross_entropy
    trained = columns >= 0
    flat = torch.where(trained, columns, -100).reshape(-1)
    ce_final = ce(final.reshape(-1, final.shape[-1]).float(), flat, reduction="none")
    ce_base = ce(base.reshape(-1, base.shape[-1]).float(), flat, reduction="none")
    w = (weights * trained).reshape(-1)
    loss = (((1 - lam) * ce_final + lam * ce_base) * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        right = (final.argmax(-1) == columns) & trained
        accepted = torch.cumprod(right.long(), dim=1).sum()
    return loss, {"tokens": int(valid.sum()), "accepted": int(accepted),
                  "anchors": int(anchors.shape[0]), "covered": int(trained.sum())}


class DrafterTrainer:
    """Owns the model, the optimiser and the checkpoints of one training run."""

    def __init__(self, spec: DrafterSpec, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, config: TrainConfig, workdir: str | Path,
                 gru_hidden: int = 256, emb_dim: int = 64, learn_mask_embedding: bool = False,
                 draft_vocab: torch.Tensor | None = None,
                 init_layers: list[dict[str, torch.Tensor]] | None = None):
        """draft_vocab: [N] strictly increasing target ids the drafter scores (a reduced
        draft vocabulary, `zoo.draft_vocab`); spec.draft_vocab_size must be N. init_layers:
        state dicts of target decoder layers to start the draft layers from (else random)."""
        torch.manual_seed(config.seed)
        self.spec, self.config, self.workdir = spec, config, Path(workdir)
        if (0 if draft_vocab is None else draft_vocab.numel()) != spec.draft_vocab_size:
            raise ValueError(f"draft_vocab has {0 if draft_vocab is None else draft_vocab.numel()}"
                             f" ids; the spec's draft_vocab_size is {spec.draft_vocab_size}")
        self.backbone = DFlashBackbone(spec, embed_weight.float(), lm_head_weight.float())
        self.backbone.set_draft_vocab(draft_vocab)
        if learn_mask_embedding:   # targets without a mask token (SmolLM2): learn its input
            self.backbone.mask_embedding = torch.nn.Parameter(torch.zeros(spec.hidden_size))
        self.head = DominoGRUHead(spec.hidden_size, gru_hidden, emb_dim, spec.output_size,
                                  embed_weight.float(), num_uncorrected=1)
        self._init_weights()
        for layer, weights in zip(self.backbone.layers, init_layers or ()):
            # a target layer's weights (Llama / Qwen names); Qwen3's q/k norms stay at 1
            missing, _ = layer.load_state_dict(weights, strict=False)
            if any(not k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing):
                raise ValueError(f"the target layer lacks {missing} of a draft layer")
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
                "config": asdict(self.config), "draft_vocab": self.backbone.draft_vocab}

    def save(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(self.state(), tmp)
        os.replace(tmp, self.checkpoint_path)

    def warm_start(self, folder: str | Path) -> None:
        """Start from an exported Domino folder's weights (a fresh optimiser): continue a
        run whose checkpoint is gone, or train a shipped drafter further. The folder must
        match this run's shapes and draft vocabulary; a resumed checkpoint overrides it."""
        from vllm_dartree.drafter.checkpoint import read_safetensors
        tensors = {}
        for shard in sorted(Path(folder).glob("*.safetensors")):
            tensors.update(read_safetensors(shard))
        vocab = tensors.pop(DRAFT_VOCAB_KEY, None)
        ours = self.backbone.draft_vocab
        if (vocab is None) != (ours is None) or (vocab is not None and not torch.equal(
                vocab.long(), ours)):
            raise ValueError(f"{folder} has another draft vocabulary than this run")
        params = {**dict(self.backbone.named_parameters()), **dict(self.head.named_parameters())}
        grown = self._grow_layers(tensors, folder)
        missing = sorted(set(params) - set(tensors))
        if missing:
            raise ValueError(f"{folder} lacks {missing[:4]} of this run's drafter")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(tensors[name].shape) != tuple(p.shape):
                    raise ValueError(f"{folder}: {name} is {list(tensors[name].shape)}, this "
                                     f"run's is {list(p.shape)}")
                p.copy_(tensors[name].reshape(p.shape).float())
        if grown:
            print(f"warm start: {grown} draft layer(s) added after the folder's, as copies of "
                  f"its last with zero output projections (the same drafter, to begin with)",
                  flush=True)

    def _grow_layers(self, tensors: dict[str, torch.Tensor], folder: str | Path) -> int:
        """A folder with fewer draft layers than this run grows into it without changing
        what it drafts: each missing layer starts as a copy of the folder's last layer whose
        attention and MLP output projections are zero, so it adds nothing to the residual
        stream until training moves them (the zero-initialised residual branch of ReZero /
        Fixup). Returns how many layers were added (0: shapes as they were)."""
        have = {int(k.split(".")[1]) for k in tensors if k.startswith("layers.")}
        ours = len(self.backbone.layers)
        if not have or len(have) >= ours:
            return 0
        if have != set(range(len(have))):
            raise ValueError(f"{folder}: draft layers {sorted(have)} are not 0..{len(have) - 1}")
        last = f"layers.{len(have) - 1}."
        for i in range(len(have), ours):
            for key in [k for k in tensors if k.startswith(last)]:
                name = f"layers.{i}." + key[len(last):]
                zero = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                tensors[name] = torch.zeros_like(tensors[key]) if zero else tensors[key].clone()
        return ours - len(have)

    def _resume(self) -> None:
        if not self.checkpoint_path.exists():
            return
        state = torch.load(self.checkpoint_path, weights_only=False)
        saved, ours = state.get("draft_vocab"), self.backbone.draft_vocab
        if (saved is None) != (ours is None) or (saved is not None and not torch.equal(saved,
                                                                                    ours)):
            raise ValueError(f"{self.checkpoint_path} was trained with another draft vocabulary"
                             " than this run's: use a new --workdir or the same --draft-vocab")
        self.backbone.load_state_dict(state["backbone"], strict=False)
        self.head.load_state_dict(state["head"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step, self.history = state["step"], state["history"]

    # -- training --------------------------------------------------------------------------
    def _anchors(self, shard: FeatureShard) -> torch.Tensor:
        lo, hi = shard.anchor_range()
        count = min(self.config.anchors_per_sequence, hi - lo)
        return lo + torch.randperm(hi - lo, generator=self.generator)[:count].sort().values

    def train_step(self, shards: list[FeatureShard]) -> dict:
        cfg = self.config
        picks = torch.randint(len(shards), (cfg.sequences_per_step,), generator=self.generator)
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr_at(self.step)
        self.optimizer.zero_grad()
        total, stats = 0.0, {"tokens": 0, "accepted": 0, "anchors": 0, "covered": 0}
        for i in picks.tolist():
            shard = shards[i]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, s = domino_loss(self.backbone, self.head, shard,
                                      self._anchors(shard), cfg.gamma,
                                      cfg.lam(self.step))
            (loss / len(picks)).backward()
            total += float(loss.detach()) / len(picks)
            stats = {k: stats[k] + s[k] for k in stats}
        torch.nn.utils.clip_grad_norm_(
            [p for m in (self.backbone, self.head) for p in m.parameters()], 1.0)
        self.optimizer.step()
        self.step += 1
        record = {"step": self.step, "loss": total,
                  "tf_accept": stats["accepted"] / max(1, stats["anchors"]),
                  "positions": stats["covered"]}   # supervised (anchor, depth) labels
        self.history.append(record)
        if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
            self.save()
        return record

    def evaluate(self, shards: list[FeatureShard], window: int | None = None) -> float:
        return held_out_acceptance(self.backbone, self.head, shards, window)


@torch.no_grad()
def held_out_acceptance(backbone: DFlashBackbone, head: DominoGRUHead,
                        shards: list[FeatureShard], window: int | None = None) -> float:
    """Mean teacher-forced chain acceptance length per anchor on held-out sequences (16
    evenly spaced anchors per sequence, in its response: where the drafter will draft).
    `window`: only in the response's first `window` tokens (`bench.tau` drafts in the first
    48; acceptance there is lower: the shipped SmolLM2 drafter accepts 0.78 there against
    0.86 over whole responses)."""
    accepted = anchors = 0
    for shard in shards:
        lo, hi = shard.anchor_range()
        if window is not None:
            hi = min(hi, lo + window)
        a = torch.arange(lo, hi, max(1, (hi - lo) // 16))
        _, s = domino_loss(backbone, head, shard, a, 7.0, 0.0)
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
    if trainer.backbone.draft_vocab is not None:
        tensors[DRAFT_VOCAB_KEY] = trainer.backbone.draft_vocab.to(torch.int64).contiguous()
    config = {
        "architectures": ["DominoDraftModel"], "model_type": "qwen3",
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "vocab_size": spec.vocab_size, "block_size": spec.query_len,
        **({"draft_vocab_size": spec.draft_vocab_size} if spec.draft_vocab_size else {}),
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


def spec_for_target(target_config, layer_ids: list[int], num_layers: int = 1,
                    block_size: int = 16, mask_token_id: int = 0,
                    draft_vocab_size: int = 0) -> DrafterSpec:
    """A Domino spec sized like the target (its hidden size, heads and RoPE)."""
    heads = target_config.num_attention_heads
    return DrafterSpec(
        format="domino", hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size, num_layers=num_layers,
        num_heads=heads, num_kv_heads=getattr(target_config, "num_key_value_heads", heads),
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        rope_theta=float(getattr(target_config, "rope_theta", 1e6) or 1e6),
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        vocab_size=target_config.vocab_size, target_layer_ids=tuple(layer_ids),
        mask_token_id=mask_token_id, query_len=block_size, depth_offset=0,
        num_depths=block_size, num_uncorrected=1, draft_vocab_size=draft_vocab_size)


def _has_amx() -> bool:
    """The CPU multiplies bf16 matrices in AMX tiles (Sapphire Rapids and later)."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _draft_vocab(args, train: list[FeatureShard], held: list[FeatureShard], tcfg):
    """The run's draft vocabulary: chosen once from the training responses (EOS always in),
    then read back from WORKDIR/draft_vocab.pt so a resumed run keeps it."""
    from vllm_dartree.zoo.draft_vocab import coverage, select_draft_vocab
    path = args.workdir / "draft_vocab.pt"
    if path.exists():
        vocab = torch.load(path)
    elif not args.draft_vocab or args.draft_vocab >= tcfg.vocab_size:
        vocab = None
    else:
        eos = tcfg.eos_token_id if isinstance(tcfg.eos_token_id, list) else [tcfg.eos_token_id]
        vocab = select_draft_vocab(((s.tokens, s.first_anchor) for s in train), args.draft_vocab,
                                   tcfg.vocab_size, always=[t for t in eos if t is not None])
        args.workdir.mkdir(parents=True, exist_ok=True)
        torch.save(vocab, path)
    if vocab is not None:
        share = coverage(((s.tokens, s.first_anchor) for s in held), vocab)
        print(f"draft vocabulary: {vocab.numel()} of {tcfg.vocab_size} target tokens; "
              f"{100 * share:.2f}% of the held-out response tokens inside", flush=True)
    return vocab


def _folder_shards(folder: Path, sources: tuple[str, ...]) -> list[FeatureShard]:
    """A zoo.data folder's sequences, source by source (ShareGPT's features-*.pt first)."""
    shards = load_shards(sorted(folder.glob("features-*.pt")), folder / "responses.jsonl")
    for source in sources[1:]:
        shards += load_shards(sorted(folder.glob(f"{source}-features-*.pt")))
    return shards


def main(argv: list[str] | None = None) -> float | None:
    """Train (or --evaluate); returns the final held-out acceptance (None without one)."""
    parser = argparse.ArgumentParser(
        description="Train a Domino drafter on features from `python -m vllm_dartree.zoo.data`"
                    " (resumes from WORKDIR/checkpoint.pt).")
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--data", required=True, type=Path, help="the zoo.data workdir")
    parser.add_argument("--layers", required=True, help="target layer ids used by zoo.data")
    parser.add_argument("--workdir", type=Path, help="the run's checkpoints (required to train)")
    parser.add_argument("--export", type=Path, help="write the Domino folder here at the end")
    parser.add_argument("--evaluate", type=Path, metavar="DRAFTER",
                        help="only measure this Domino folder's held-out acceptance and exit")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gru-hidden", type=int, default=256)
    parser.add_argument("--emb-dim", type=int, default=64)
    parser.add_argument("--warm-start", type=Path, metavar="DRAFTER",
                        help="start from an exported Domino folder's weights (when WORKDIR "
                             "has no checkpoint yet); a folder with fewer draft layers than "
                             "--draft-layers grows into them, drafting the same at first")
    parser.add_argument("--init-from-target", metavar="L1[,L2]",
                        help="start the draft layers from these target layers (0-based ids; "
                             "default: random)")
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="score only the N most frequent response tokens of the training "
                             "data (0: the target's whole vocabulary); fixed at the first run "
                             "in WORKDIR/draft_vocab.pt")
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    parser.add_argument("--lambda-start", type=float, default=TrainConfig.lambda_start,
                        help="first weight of the uncorrected CE (a warm start continuing a "
                             "finished run: its --lambda-end)")
    parser.add_argument("--lambda-end", type=float, default=TrainConfig.lambda_end,
                        help="final weight of the uncorrected CE (1 - it: the corrected one's)")
    parser.add_argument("--anchors", type=int, default=TrainConfig.anchors_per_sequence,
                        help="anchors per sequence and step")
    parser.add_argument("--held-out", type=int, default=16)
    parser.add_argument("--eval-data", type=Path, metavar="DIR",
                        help="a second held-out set, every sequence of another zoo.data workdir "
                             "(e.g. zoo.data --prompts 0 --bench-prompts 4: the target's "
                             "responses to bench.tau's prompts), measured "
                             f"in its responses' first {EARLY_WINDOW} tokens")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="matrix products in bf16 autocast (fp32 master weights) or fp32; "
                             "auto: bf16 where the CPU has AMX, else fp32 (bf16 without AMX "
                             "is ~25x slower: python -m vllm_dartree.bench.train_speed --bf16)")
    args = parser.parse_args(argv)
    if args.workdir is None and args.evaluate is None:
        parser.error("--workdir is required to train")
    if list(args.data.glob("bench-features-*.pt")):
        parser.error(f"--data {args.data} holds responses to the tau table's own prompts "
                     "(zoo.data --bench-prompts): they are for --eval-data, never for training")

    from transformers import AutoConfig, AutoModelForCausalLM

    tcfg = AutoConfig.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    layer_ids = [int(i) for i in args.layers.split(",")]
    # ShareGPT shards first (the held-out sequences come from them), then the other sources
    shards = _folder_shards(args.data, SOURCES)
    held, train = shards[:args.held_out], shards[args.held_out:]
    extra = _folder_shards(args.eval_data, SOURCES + ("bench",)) if args.eval_data else []
    if args.eval_data and not extra:
        parser.error(f"--eval-data {args.eval_data}: no features-*.pt or SOURCE-features-*.pt "
                     "there (zoo.data writes them)")
    if args.evaluate:
        from vllm_dartree.drafter import TargetInfo, load_drafter
        drafter = load_drafter(args.evaluate, TargetInfo(tcfg.hidden_size, tcfg.vocab_size,
                                                         tcfg.num_hidden_layers),
                               embed, head, dtype=torch.float32)
        accepted = held_out_acceptance(drafter.backbone, drafter.head, held)
        early = held_out_acceptance(drafter.backbone, drafter.head, held, EARLY_WINDOW)
        print(f"{args.evaluate}: held-out accepted {accepted:.3f} ({len(held)} sequences x "
              f"16 anchors; {early:.3f} in the responses' first {EARLY_WINDOW} tokens)")
        if extra:
            print(f"{args.evaluate}: {args.eval_data} accepted "
                  f"{held_out_acceptance(drafter.backbone, drafter.head, extra, EARLY_WINDOW):.3f}"
                  f" ({len(extra)} sequences, first {EARLY_WINDOW} tokens)")
        return accepted
    vocab = _draft_vocab(args, train, held, tcfg)
    spec = spec_for_target(tcfg, layer_ids, args.draft_layers, args.block_size,
                           draft_vocab_size=0 if vocab is None else vocab.numel())
    bf16 = args.precision == "bf16" or (args.precision == "auto" and _has_amx())
    print(f"matrix products in {'bf16 autocast' if bf16 else 'fp32'}", flush=True)
    config = TrainConfig(steps=args.steps, bf16=bf16, lr=args.lr, schedule=args.schedule,
                         lambda_start=args.lambda_start, lambda_end=args.lambda_end,
                         anchors_per_sequence=args.anchors)
    init = None
    if args.init_from_target:
        ids = [int(i) for i in args.init_from_target.split(",")]
        if len(ids) != args.draft_layers:
            parser.error(f"--init-from-target names {len(ids)} layers for "
                         f"{args.draft_layers} draft layers")
        init = [target.model.layers[i].state_dict() for i in ids]
    trainer = DrafterTrainer(spec, embed, head, config, args.workdir,
                             gru_hidden=args.gru_hidden, emb_dim=args.emb_dim,
                             learn_mask_embedding=True, draft_vocab=vocab, init_layers=init)
    if args.warm_start and trainer.step == 0:
        trainer.warm_start(args.warm_start)
        print(f"warm start from {args.warm_start}", flush=True)
    print(f"{len(train)} training / {len(held)} held-out sequences; resuming at step "
          f"{trainer.step} of {args.steps}", flush=True)
    start = time.perf_counter()
    while trainer.step < args.steps:
        record = trainer.train_step(train)
        if trainer.step % args.log_every == 0:
            rate = (time.perf_counter() - start) / args.log_every
            start = time.perf_counter()
            print(f"step {trainer.step}: loss {record['loss']:.3f}, teacher-forced accepted "
                  f"{record['tf_accept']:.2f}, {rate:.1f} s/step", flush=True)
        if trainer.step % (10 * args.log_every) == 0 and held:
            print(f"step {trainer.step}: held-out accepted {trainer.evaluate(held):.2f} "
                  f"(first {EARLY_WINDOW} tokens: {trainer.evaluate(held, EARLY_WINDOW):.2f})"
                  + (f"; --eval-data {trainer.evaluate(extra, EARLY_WINDOW):.2f}" if extra
                     else ""), flush=True)
    if args.export:
        export_domino(trainer, args.export, tcfg.num_hidden_layers)
        print(f"wrote {args.export}")
    return trainer.evaluate(held) if held else None


if __name__ == "__main__":
    main()
