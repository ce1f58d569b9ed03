"""GGUF -> Hugging Face conversion on a tiny GGUF written by the test."""

import torch

from vllm_dartree.testing import write_tiny_gguf
from vllm_dartree.zoo.convert import CHATML_TEMPLATE, convert_gguf


def test_converted_folder_gives_the_gguf_models_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = write_tiny_gguf(tmp_path / "src" / "tiny.gguf")
    out = convert_gguf(gguf, tmp_path / "hf", dtype=torch.float32, chat_template=CHATML_TEMPLATE)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not hasattr(converted.config, "quantization_config")
    ids = torch.tensor([[5, 104, 105, 7, 200, 298]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, direct(ids).logits)
    tok_gguf = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("hi there").input_ids == tok_gguf("hi there").input_ids
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)


def test_conversion_is_skipped_when_done(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(gguf, tmp_path / "hf")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    convert_gguf(gguf, tmp_path / "hf")
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
