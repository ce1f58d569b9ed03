"""Real small models that run offline.

- `convert`: GGUF -> plain Hugging Face folder (safetensors + tokenizer + chat template).
- `smollm2`: fetch and prepare SmolLM2-135M-Instruct (`python -m vllm_dartree.zoo.smollm2`).
"""

__all__: list[str] = []
