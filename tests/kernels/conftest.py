"""Kernel tests run on CUDA when it is there (TRITON_INTERPRET unset), otherwise on the CPU under the
Triton interpreter. The interpreter is chosen when kernels are decorated, so TRITON_INTERPRET is decided
here, before any test module imports triton or kernels."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    assert "kernels" not in sys.modules, (
        "kernels was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; set it in "
        "tests/conftest.py or import kernels lazily")
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# per dtype: (atol, rtol) for a kernel against the torch path in the same dtype
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cpu under the interpreter; the GPU otherwise (a clear failure when there is none)."""
    if INTERPRET:
        return torch.device("cpu")
    assert torch.cuda.is_available(), "TRITON_INTERPRET is off but CUDA is unavailable: set TRITON_INTERPRET=1"
    return torch.device("cuda")


@pytest.fixture(scope="session")
def assert_close():
    """assert_close(actual, expected, precision=None): same dtype and shape, values within the tolerance of
    `precision` (default: expected's dtype)."""

    def check(actual: torch.Tensor, expected: torch.Tensor, precision: torch.dtype | None = None) -> None:
        atol, rtol = TOLERANCES[precision or expected.dtype]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
            f"{actual.dtype} {tuple(actual.shape)} != {expected.dtype} {tuple(expected.shape)}")
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)

    return check
