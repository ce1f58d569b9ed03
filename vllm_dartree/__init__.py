"""vllm-dartree: DARTree tree speculative decoding with block-diffusion drafters for vLLM.

Subpackages:
- `tree`: engine-agnostic tree construction, masks and verification walks (pure torch).
- `drafter`: drafter models and correction heads (pure torch).
- `bench`: benchmarks that print ratios measured in one run.
- `csrc_triton`: Triton kernels, reached through `vllm_dartree.ops`.
"""

from vllm_dartree.config import DARTreeConfig

__version__ = "0.1.0"

__all__ = ["DARTreeConfig", "__version__"]
