"""Triton kernels with the signatures of the `Ops` protocol (gpu_worker/executor/ops), so the model can use
them in place of the torch reference ops. Import this package only after deciding on TRITON_INTERPRET (CPU runs need it set to 1
before the first import of triton)."""

from kernels.activation import silu_and_mul
from kernels.kv_cache_store import store_kv_cache
from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm
from kernels.rotary import rotary_embedding

__all__ = ["paged_attention", "rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache"]
