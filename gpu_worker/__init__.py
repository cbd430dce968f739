"""kvfleet's engine. `from gpu_worker import LLM, SamplingParams` (loaded lazily: importing a torch-free
module such as gpu_worker.core.block_pool does not import torch)."""

from __future__ import annotations

import importlib
import os
from typing import Any

# Large CPU tensors (weights, the paged KV cache, prefill activations) on transparent huge pages: torch's CPU
# allocator aligns allocations of 2 MiB and more and madvises them when this is set. Under a VM's nested
# paging a TLB miss costs a two-level walk; measured on a 2-core Zen 3 guest: decode steps 12% and prefill
# steps 17% faster. torch reads the variable once, at its first CPU allocation, so it is set here, before
# kvfleet allocates anything; THP_MEM_ALLOC_ENABLE=0 turns it off (as does THP "never" in
# /sys/kernel/mm/transparent_hugepage/enabled).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_EXPORTS = {
    "LLM": "gpu_worker.engine.llm",
    "LLMEngine": "gpu_worker.engine.llm_engine",
    "RequestOutput": "gpu_worker.engine.outputs",
    "CompletionOutput": "gpu_worker.engine.outputs",
    "SamplingParams": "shared.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
