"""The vLLM 0.32 integration: the only package of vllm-dartree that imports vllm.

- `plugin`: the `vllm.general_plugins` entry point; turns the user-facing
  `{"method": "dartree", ...}` speculative config into what vLLM runs (the `custom_class`
  carrier, `additional_config["dartree"]`, the dartree worker class).
- `settings`: the dartree block of `additional_config`, parsed once per process.
- `drafters`: what the runner drafts with (a checkpoint's backbone + head, or the test oracle).
- `runner`: the mixin that turns the V1 runner's chain speculation into tree speculation.
- `cpu_attention`: the CPU attention backend with tree masks, owning its KV layout.
- `worker`: the CPU / GPU workers that install the runner and the backend.
- `proposer`: the `custom_class` carrier vLLM instantiates (loads the drafter).

Importing this package imports nothing from vllm; its modules do.
"""

__all__: list[str] = []
