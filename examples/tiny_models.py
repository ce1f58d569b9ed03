"""Write a tiny random target, tiny drafters in every released format, and a prompt file.

    python examples/tiny_models.py OUT_DIR

OUT_DIR/target (Qwen3, real BPE tokenizer), OUT_DIR/{dflash,domino,domino-legacy,dspark}
and OUT_DIR/prompts.jsonl: enough to try `python -m vllm_dartree.reference` offline. The
weights are random, so drafts are rarely accepted (tau near 1): these models exercise the
machinery, they do not show speedups.
"""

import json
import sys
from pathlib import Path

from vllm_dartree.testing import DRAFTER_FORMATS, write_tiny_drafter, write_tiny_target

PROMPTS = ["Write a function that adds two numbers.", "def fibonacci(n):",
           "Explain what a hash table is.", "import os\nimport sys\n", "class Stack:"]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = Path(sys.argv[1])
    target = write_tiny_target(out / "target", head_dim=32)   # vLLM's CPU attention: >= 32
    for fmt in DRAFTER_FORMATS:
        write_tiny_drafter(out / fmt, fmt, target)
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    print(f"wrote {out}/target, {', '.join(DRAFTER_FORMATS)} and prompts.jsonl")


if __name__ == "__main__":
    main()
