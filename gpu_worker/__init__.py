"""kvfleet's engine. `from gpu_worker import LLM, SamplingParams` (loaded lazily: importing a torch-free
module such as gpu_worker.block_pool does not import torch)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "gpu_worker.llm",
    "LLMEngine": "gpu_worker.engine",
    "RequestOutput": "gpu_worker.outputs",
    "CompletionOutput": "gpu_worker.outputs",
    "SamplingParams": "shared.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
