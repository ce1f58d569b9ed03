"""Run the kernel tests on a real device: `DARTREE_KERNEL_DEVICE=cuda TRITON_INTERPRET=0
python -m pytest tests/kernels` compiles the Triton kernels instead of interpreting them.

The tests build their inputs on the CPU; each kernel entry point the test modules call is
wrapped to run on the device: every tensor argument's storage is copied there whole (views
keep their strides and offsets, so K/V halves of one cache tensor stay views of one
buffer), the kernel runs, the storages are copied back (kernels that write into `out=` or
into their inputs are seen doing so) and the results come back to the CPU. Unset (CI), the
kernels run under the interpreter on CPU tensors, as before.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

DEVICE = os.environ.get("DARTREE_KERNEL_DEVICE")
ENTRY_POINTS = ("tree_attention", "tree_ancestor_mask", "tree_ancestor_bitmask",
                "score_and_select_triton")


def _on_device(fn, device):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        storages: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

        def move(x):
            if not isinstance(x, torch.Tensor):
                return x
            host = x.untyped_storage()
            key = host.data_ptr()
            if key not in storages:
                storages[key] = (host, host.to(device=device))
            moved = torch.empty(0, dtype=x.dtype, device=device)
            return moved.set_(storages[key][1], x.storage_offset(), x.shape, x.stride())

        result = fn(*(move(a) for a in args), **{k: move(v) for k, v in kwargs.items()})
        for host, moved in storages.values():
            host.copy_(moved.cpu())

        def back(x):
            if isinstance(x, torch.Tensor):
                return x.cpu()
            if isinstance(x, tuple):
                return type(x)(back(y) for y in x)
            return x
        return back(result)
    return run


@pytest.fixture(autouse=True)
def _kernels_on_device(request, monkeypatch):
    if DEVICE is None:
        return
    module = request.module
    for name in ENTRY_POINTS:
        fn = getattr(module, name, None)
        if fn is not None:
            monkeypatch.setattr(module, name, _on_device(fn, torch.device(DEVICE)))
