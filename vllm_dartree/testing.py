"""Tiny models for tests and examples: a random Qwen3 target with a real tokenizer, and tiny
drafter checkpoints in each released format (same keys, nesting and config layout, small dims).

Everything is built offline and deterministically from a seed:

    target = write_tiny_target(tmp / "target")
    drafter = write_tiny_drafter(tmp / "domino", "domino", target)

The tokenizer is a byte-level BPE trained on this machine's Python standard library sources,
with ChatML special tokens and a `<|mask|>` token for the drafters' MASK slots.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_dartree.drafter.spec import build_target_layer_ids

__all__ = ["SPECIAL_TOKENS", "CHAT_TEMPLATE", "DRAFTER_FORMATS", "OracleDraftModel",
           "build_tokenizer", "write_tiny_target", "write_tiny_drafter", "write_tiny_gguf"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DRAFTER_FORMATS = ("dflash", "domino", "domino-legacy", "dspark")


def _training_text(max_bytes: int = 400_000) -> list[str]:
    """Deterministic local text: the first files of the standard library, sorted by name."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        out.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return out


def build_tokenizer(vocab_size: int = 1024):
    """A real byte-level BPE tokenizer (transformers' fast tokenizer) with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _rand(gen: torch.Generator, *shape: int, std: float = 0.05) -> torch.Tensor:
    return std * torch.randn(*shape, generator=gen)


def write_tiny_target(folder: str | Path, *, hidden: int = 64, layers: int = 6, heads: int = 4,
                      kv_heads: int = 2, head_dim: int = 16, intermediate: int = 128,
                      vocab_size: int = 1024, seed: int = 0) -> Path:
    """A random Qwen3ForCausalLM folder (HF format, safetensors) with a real tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():   # larger logits than the default init, so greedy paths are varied
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def _target_config(target: str | Path) -> dict:
    return json.loads((Path(target) / "config.json").read_text())


def _backbone_tensors(gen, hidden, intermediate, layers, heads, kv_heads, head_dim, n_feats):
    out = {"fc.weight": _rand(gen, hidden, n_feats * hidden),
           "hidden_norm.weight": 1 + _rand(gen, hidden), "norm.weight": 1 + _rand(gen, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": _rand(gen, heads * head_dim, hidden, std=0.2),
            p + "self_attn.k_proj.weight": _rand(gen, kv_heads * head_dim, hidden, std=0.2),
            p + "self_attn.v_proj.weight": _rand(gen, kv_heads * head_dim, hidden, std=0.2),
            p + "self_attn.o_proj.weight": _rand(gen, hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": 1 + _rand(gen, head_dim),
            p + "self_attn.k_norm.weight": 1 + _rand(gen, head_dim),
            p + "mlp.gate_proj.weight": _rand(gen, intermediate, hidden),
            p + "mlp.up_proj.weight": _rand(gen, intermediate, hidden),
            p + "mlp.down_proj.weight": _rand(gen, hidden, intermediate),
            p + "input_layernorm.weight": 1 + _rand(gen, hidden),
            p + "post_attention_layernorm.weight": 1 + _rand(gen, hidden),
        })
    return out


def write_tiny_drafter(folder: str | Path, fmt: str, target: str | Path, *, layers: int = 2,
                       block_size: int | None = None, gru_hidden: int = 24, emb_dim: int = 12,
                       markov_rank: int = 8, confidence: bool = True, shards: int = 1,
                       seed: int = 0, draft_vocab: int = 0) -> Path:
    """A drafter checkpoint for `target` in one of DRAFTER_FORMATS, random weights.

    "domino-legacy" is the early Domino layout (projector_type "causal_v5", head weights
    under `logit_head.`); "dspark" carries its own copies of embed_tokens / lm_head, as the
    released DSpark checkpoints do. `draft_vocab` > 0 (DFlash / Domino): a reduced draft
    vocabulary of that many random target ids (`draft_vocab_ids`).
    """
    if fmt not in DRAFTER_FORMATS:
        raise ValueError(f"fmt = {fmt!r} must be one of {DRAFTER_FORMATS}")
    tcfg = _target_config(target)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    heads, kv_heads, head_dim = 4, 2, tcfg.get("head_dim", 16)
    intermediate = 2 * hidden
    layer_ids = build_target_layer_ids(tcfg["num_hidden_layers"], layers)
    added = json.loads((Path(target) / "tokenizer.json").read_text())["added_tokens"]
    mask_id = next(int(t["id"]) for t in added if t["content"] == "<|mask|>")
    block = block_size or (7 if fmt == "dspark" else 16)
    tensors = _backbone_tensors(gen, hidden, intermediate, layers, heads, kv_heads, head_dim,
                                len(layer_ids))
    vocab_ids = None
    if draft_vocab:
        if fmt == "dspark":
            raise ValueError("a draft vocabulary is for DFlash / Domino drafters")
        vocab_ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    config = {
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": tcfg.get("rope_theta", 10000.0), "vocab_size": vocab,
        "num_target_layers": tcfg["num_hidden_layers"], "block_size": block, "model_type": "qwen3",
    }
    if fmt == "dspark":
        config.update(architectures=["Qwen3DSparkModel"], target_layer_ids=layer_ids,
                      mask_token_id=mask_id, num_anchors=64, markov_rank=markov_rank,
                      markov_head_type="vanilla", enable_confidence_head=confidence,
                      confidence_head_with_markov=True, sample_from_anchor=True)
        tensors.update({"markov_head.markov_w1.weight": _rand(gen, vocab, markov_rank, std=0.5),
                        "markov_head.markov_w2.weight": _rand(gen, vocab, markov_rank, std=0.5),
                        "embed_tokens.weight": _rand(gen, vocab, hidden),
                        "lm_head.weight": _rand(gen, vocab, hidden)})
        if confidence:
            tensors.update({"confidence_head.proj.weight": _rand(gen, 1, hidden + markov_rank),
                            "confidence_head.proj.bias": _rand(gen, 1)})
    else:
        dcfg = {"mask_token_id": mask_id, "target_layer_ids": layer_ids}
        config.update(architectures=["DFlashDraftModel"], dflash_config=dcfg)
        if fmt.startswith("domino"):
            legacy = fmt == "domino-legacy"
            dcfg.update(projector_type="causal_v5" if legacy else "domino", emb_dim=emb_dim,
                        gru_hidden_dim=gru_hidden, pure_draft_prefix_len=1, shift_label=True)
            if not legacy:
                config["architectures"] = ["DominoDraftModel"]
            prefix = "logit_head." if legacy else ""
            tensors.update({
                prefix + "prefix_gru.weight_ih_l0": _rand(gen, 3 * gru_hidden, hidden, std=0.3),
                prefix + "prefix_gru.weight_hh_l0": _rand(gen, 3 * gru_hidden, gru_hidden, std=0.3),
                prefix + "embed_proj.0.weight": _rand(gen, emb_dim, hidden + gru_hidden, std=0.3),
                prefix + "embed_proj.2.weight": _rand(gen, draft_vocab or vocab, emb_dim,
                                                      std=0.5),
            })
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    if vocab_ids is not None:
        config["draft_vocab_size"] = draft_vocab
        tensors["draft_vocab_ids"] = vocab_ids
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _save_shards(folder, tensors, shards)
    return folder


def _save_shards(folder: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        save_file(part, str(folder / file))
        weight_map.update({k: file for k in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


class OracleDraftModel:
    """A drafter that knows the target: depth d's base logits put (almost) all mass on the
    target's own greedy continuation, so its chain is always accepted to full depth."""

    head = None

    def __init__(self, target: torch.nn.Module, depths: int = 8, layer_ids: tuple[int, ...] = (0,),
                 vocab_ids: torch.Tensor | None = None):
        """vocab_ids: score only these target ids (a reduced draft vocabulary): where the
        continuation leaves it, the oracle cannot propose it."""
        self.target, self.depths, self.layer_ids = target, depths, layer_ids
        self.vocab_ids = vocab_ids
        self.tokens: list[int] = []

    def extend(self, tokens: list[int], features: torch.Tensor) -> None:
        self.tokens += list(tokens)

    @torch.no_grad()
    def draft(self, root: int):
        from transformers import DynamicCache

        from vllm_dartree.drafter import DraftOutput
        seq, cache, cont = torch.tensor([self.tokens + [root]]), DynamicCache(), []
        for _ in range(self.depths):
            logits = self.target(seq, past_key_values=cache, use_cache=True).logits[0, -1]
            cont.append(int(logits.argmax()))
            seq = torch.tensor([[cont[-1]]])
        vocab = self.target.config.vocab_size
        base = torch.full((1, self.depths, vocab), -20.0)
        base[0, torch.arange(self.depths), torch.tensor(cont)] = 0.0
        if self.vocab_ids is not None:
            base = base[..., self.vocab_ids]
        return DraftOutput(hidden=None, base_logits=base, vocab_ids=self.vocab_ids)


def write_tiny_gguf(path: str | Path, *, vocab: int = 300, hidden: int = 32, layers: int = 2,
                    seed: int = 0) -> Path:
    """A tiny llama GGUF (f32 tensors, a byte-level BPE vocabulary), as llama.cpp lays it out:
    for testing the GGUF -> Hugging Face conversion without downloading a model."""
    import numpy as np
    from gguf import GGUFWriter
    from tokenizers import pre_tokenizers

    heads, kv_heads, ffn = 4, 2, 2 * hidden
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())            # the 256 byte symbols
    tokens = alphabet + [alphabet[104] + alphabet[105]] + \
        [f"w{i}" for i in range(vocab - 259)] + ["<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 2) + [3, 3])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_merges([alphabet[104] + " " + alphabet[105]])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(seed)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (0.3 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden)
    kv = kv_heads * hidden // heads
    for i in range(layers):
        for name, shape in (("attn_norm", (hidden,)), ("ffn_norm", (hidden,)),
                            ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            tensor(f"blk.{i}.{name}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
