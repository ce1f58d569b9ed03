"""Shared test setup: Triton kernels run through the interpreter on CPU tensors."""

import os

# Must be set before any Triton kernel is decorated (i.e. before csrc_triton is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
