"""A decode step's decoder layers in one native call (csrc/decode_layers.h, `decode_layers`).

A decode step runs every layer's ten ops over a few dozen rows: the kernels take ~1 ms a layer, and the Python
between them (the module calls, the op wrappers, views, allocations) ~60 us more, while the other OpenMP
threads spin in their barrier. The native stack calls the same kernels in the same order with the same
rounding, so the hidden states are bit for bit those of the model's Python forward (tests/kernels). It applies
where every op of the layer is kvfleet's native one: CPU, float32 or bfloat16, the panel GEMM as the matmul
path for the step's rows, and no tensor parallelism (the all-reduces sit between the ops). Other steps, and
prefill chunks, take the Python forward.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from gpu_worker.executor.ops import AttentionMetadata
from gpu_worker.executor.ops.cpu import kernels as cpu_kernels
from gpu_worker.executor.ops.cpu import linear as cpu_linear
from gpu_worker.executor.ops.cpu import native_ops

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# the op kinds the native stack times when profiled (DecodeOp in the C++), by the names of the Python ops
OP_NAMES = ("rms_norm", "linear", "rotary_embedding", "store_kv_cache", "paged_attention", "silu_and_mul")


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias",
                                        "o_bias", "gate_up_bias", "down_bias", "q_norm", "k_norm", "key_cache",
                                        "value_cache")]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("inter", _I64), ("hq", _I32), ("hkv", _I32), ("d", _I32), ("block_size", _I32),
                ("head_major", _I32), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeStack:
    """Made once per model after its weights are packed (`build`), run once per decode forward (`run`)."""

    def __init__(self, model, few_rows_only: bool):
        cfg = model.arch
        self.dtype = model.embed.dtype
        self.max_rows = cpu_linear.MANY_ROWS if few_rows_only else None  # more rows: another matmul path
        self.num_layers = len(model.layers)
        self.shape = _Shape(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                            0, 0, cfg.eps, cfg.scale)
        self.table = (_Layer * self.num_layers)()  # pointers into the model's tensors (the model holds this stack)
        for entry, layer in zip(self.table, model.layers, strict=True):
            p = layer.packed
            for name, value in (("input_norm", layer.input_norm), ("post_norm", layer.post_attn_norm),
                                ("qkv", p["qkv"].data), ("o", p["o"].data), ("gate_up", p["gate_up"].data),
                                ("down", p["down"].data), ("qkv_bias", layer.qkv_bias), ("o_bias", layer.o_bias),
                                ("gate_up_bias", layer.gate_up_bias), ("down_bias", layer.down_bias),
                                ("q_norm", layer.q_norm), ("k_norm", layer.k_norm)):
                setattr(entry, name, _ptr(value))
        self._caches: list | None = None  # the KV caches the table points at
        self._fn = cpu_kernels.kernel("decode_layers", self.dtype)
        # set (a profiler): called after each run with that run's seconds per op kind (OP_NAMES)
        self.on_profile: Callable[[dict[str, float]], None] | None = None

    @classmethod
    def build(cls, model, plan: cpu_linear.LinearPlan | None) -> DecodeStack | None:
        """The stack for this model, or None where one of its ops is not the native kernel (see the module)."""
        ops = model.ops
        if (plan is None or model.tp.size != 1 or model.embed.device.type != "cpu"
                or model.embed.dtype not in cpu_kernels.SUFFIX):
            return None
        native = native_ops.cpu_ops()
        if not native or any(getattr(ops, name) is not fn for name, fn in native.items()):
            return None  # the torch or Triton ops (tests, TRITON_INTERPRET): their rounding, not the kernels'
        packed = [layer.packed.get(name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
        if any(p is None or p.kind != "panel" or p.upcast for p in packed):  # (panel: the GEMM is compiled in)
            return None
        return cls(model, few_rows_only=any(p.many is not None for p in packed))

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """hidden [T, H] (the embeddings; overwritten) through every layer -> (the last layer's output, its
        residual), as the Python forward's loop gives them; None where this step is not all decode tokens (or
        has more rows than the panel GEMM's path takes)."""
        n = hidden.shape[0]
        if n != meta.context_lens.shape[0] or (self.max_rows is not None and n >= self.max_rows):
            return None
        if self._caches is not kv_caches:
            layouts = {cpu_kernels.kv_layout(key_cache, value_cache) for key_cache, value_cache in kv_caches}
            if len(layouts) != 1 or None in layouts:
                return None  # caches the kernels cannot read (odd strides, mixed layouts): the Python forward
            for entry, (key_cache, value_cache) in zip(self.table, kv_caches, strict=True):
                entry.key_cache, entry.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
            self.shape.block_size, self.shape.head_major = kv_caches[0][0].shape[1], layouts.pop()
            self._caches = kv_caches
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        pos, slots = cpu_kernels.as_index(positions), cpu_kernels.as_index(meta.slot_mapping)
        tables = cpu_kernels.as_index(meta.block_tables, torch.int32)
        lens = cpu_kernels.as_index(meta.context_lens, torch.int32)
        on_profile = self.on_profile
        seconds = (ctypes.c_double * len(OP_NAMES))() if on_profile is not None else None
        self._fn(ctypes.addressof(self.table), self.num_layers, ctypes.addressof(self.shape), hidden.data_ptr(),
                 residual.data_ptr(), n, pos.data_ptr(), cos_sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                 tables.stride(0), lens.data_ptr(), seconds)
        if on_profile is not None:
            on_profile(dict(zip(OP_NAMES, seconds, strict=True)))
        return hidden, residual
