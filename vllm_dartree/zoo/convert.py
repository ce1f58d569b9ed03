"""Convert a GGUF model file to a plain Hugging Face folder (safetensors + tokenizer).

transformers dequantizes a GGUF on load, but the loaded object keeps GGUF metadata and cannot
be saved as is; we rebuild a plain model of the same class from its config, copy the
dequantized weights, and save them (bf16 by default) with the tokenizer and a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["convert_gguf", "CHATML_TEMPLATE"]

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_MARKER = "converted_from.json"


def convert_gguf(gguf_file: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                 chat_template: str | None = None) -> Path:
    """Write `out_dir` (skipped when it already holds this conversion); returns it.

    chat_template: used when the GGUF carries none (e.g. ChatML for SmolLM2).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    marker = out_dir / _MARKER
    stamp = {"gguf": gguf_file.name, "bytes": gguf_file.stat().st_size, "dtype": str(dtype)}
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return out_dir
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                  dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{gguf_file}: converting to {type(plain).__name__} left missing "
                           f"{sorted(set(missing) - tied)} and unexpected {sorted(unexpected)}")
    if not tokenizer.chat_template and chat_template:
        tokenizer.chat_template = chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    marker.write_text(json.dumps(stamp))
    return out_dir
