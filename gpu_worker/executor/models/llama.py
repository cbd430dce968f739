"""One decoder for the Llama family: Llama 2/3 (SmolLM2, TinyLlama; rope scaling), Mistral, Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm). Fused qkv and gate|up weights; attention reads and writes the paged KV cache.

One forward per engine step over the batch's tokens flattened: [T] ids, [T] positions.

Under tensor parallelism (`tp`, see tp_group) each rank builds this model with its share of the heads, the MLP
and the vocabulary; the o and down projections end with an all-reduce, the embedding is vocab-parallel (an
all-reduce too) and the logits are gathered.
"""

from __future__ import annotations

import types
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.executor.ops import AttentionMetadata, Ops, select_ops
from gpu_worker.executor.ops.cpu import linear as cpu_linear
from gpu_worker.executor.ops.cpu.decode_stack import DecodeStack
from gpu_worker.executor.tp_group import TPGroup, check_divisible, first_kv_head, local_kv_heads, vocab_shard

SINGLE = TPGroup(rank=0, size=1)


def rope_cos_sin_cache(config, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim]: cos | sin halves, computed as transformers does (incl. rope scaling)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    elif rope_type == "dynamic":  # NTK base for the whole context window, as vLLM does
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=max_positions)
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported")
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_positions, D/2]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: types.SimpleNamespace, ops: Ops, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg, self.ops, self.tp = cfg, ops, tp
        row_bias = tp.is_first  # a row-parallel projection's bias is added once, before the all-reduce
        h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_size, self.kv_size = hq * d, hkv * d
        self.input_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.qkv_weight = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h), requires_grad=False)
        self.qkv_bias = (nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size), requires_grad=False)
                         if cfg.qkv_bias else None)
        self.o_weight = nn.Parameter(torch.empty(h, hq * d), requires_grad=False)
        self.o_bias = nn.Parameter(torch.empty(h), requires_grad=False) if cfg.o_bias and row_bias else None
        self.q_norm = nn.Parameter(torch.empty(d), requires_grad=False) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(d), requires_grad=False) if cfg.qk_norm else None
        self.gate_up_weight = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(h, cfg.intermediate_size), requires_grad=False)
        self.gate_up_bias = (nn.Parameter(torch.empty(2 * cfg.intermediate_size), requires_grad=False)
                             if cfg.mlp_bias else None)
        self.down_bias = nn.Parameter(torch.empty(h), requires_grad=False) if cfg.mlp_bias and row_bias else None
        self.packed: dict[str, cpu_linear.PackedWeight] = {}  # name -> packed <name>_weight, after loading

    def pack_weights(self, plan: cpu_linear.LinearPlan) -> None:
        """The matmul weights in the plan's layouts, once after loading. A loaded weight that no path reads
        any more is let go (its memory serves the activations), as vLLM's CPU layers keep only the packed form."""
        self.packed = {}
        for name in ("qkv", "o", "gate_up", "down"):
            packed = plan.pack(getattr(self, f"{name}_weight"))
            if packed is not None:
                self.packed[name] = packed
                if not packed.reads_weight:
                    setattr(self, f"{name}_weight", None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops, cfg = self.ops, self.cfg
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_norm, cfg.eps)
        else:
            hidden, residual = ops.rms_norm(hidden, self.input_norm, cfg.eps, residual)
        num_tokens = hidden.shape[0]
        packed = self.packed
        qkv = cpu_linear.linear(hidden, self.qkv_weight, self.qkv_bias, packed.get("qkv"))  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = ops.rms_norm(q.reshape(-1, cfg.head_dim), self.q_norm, cfg.eps).view(num_tokens, -1)
            k = ops.rms_norm(k.reshape(-1, cfg.head_dim), self.k_norm, cfg.eps).view(num_tokens, -1)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin, cfg.head_dim, True)
        key_cache, value_cache = kv_cache
        ops.store_kv_cache(k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                           v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                           key_cache, value_cache, meta.slot_mapping)
        attn = ops.paged_attention(q.view(num_tokens, cfg.num_heads, cfg.head_dim), key_cache, value_cache,
                                   meta.block_tables, meta.query_start_loc, meta.context_lens, cfg.scale)
        hidden = cpu_linear.linear(attn.view(num_tokens, -1), self.o_weight, self.o_bias, packed.get("o"))  # [T, H]
        hidden = self.tp.all_reduce(hidden)
        hidden, residual = ops.rms_norm(hidden, self.post_attn_norm, cfg.eps, residual)
        gate_up = cpu_linear.linear(hidden, self.gate_up_weight, self.gate_up_bias, packed.get("gate_up"))  # [T, 2 I]
        hidden = cpu_linear.linear(ops.silu_and_mul(gate_up), self.down_weight, self.down_bias,
                                  packed.get("down"))  # [T, H]
        return self.tp.all_reduce(hidden), residual


def decoder_arch(config, tp: TPGroup = SINGLE) -> types.SimpleNamespace:
    """The few numbers the decoder needs, from any supported transformers config; heads, KV heads and the MLP
    size are this rank's (all of them without tensor parallelism)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    model_type = config.model_type
    check_divisible(num_heads=heads, num_kv_heads=kv_heads, intermediate_size=config.intermediate_size,
                    size=tp.size)
    return types.SimpleNamespace(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size // tp.size,
        num_layers=config.num_hidden_layers, num_heads=heads // tp.size, total_kv_heads=kv_heads,
        num_kv_heads=local_kv_heads(kv_heads, tp.size), head_dim=head_dim,
        eps=config.rms_norm_eps, scale=head_dim**-0.5, vocab_size=config.vocab_size,
        qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(getattr(config, "attention_bias", False)),
        qk_norm=model_type == "qwen3", mlp_bias=bool(getattr(config, "mlp_bias", False)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, *, max_positions: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", use_triton: bool | None = None, tp: TPGroup = SINGLE):
        super().__init__()
        self.config, self.tp = config, tp
        self.arch = cfg = decoder_arch(config, tp)
        self.ops = select_ops(torch.device(device), use_triton)
        self.vocab_first, _, shard = vocab_shard(cfg.vocab_size, tp.rank, tp.size)  # this rank's vocabulary rows
        self.embed = nn.Parameter(torch.empty(shard, cfg.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.ops, tp) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Parameter(torch.empty(shard, cfg.hidden_size), requires_grad=False))
        self.to(device=device, dtype=dtype)
        cos_sin = rope_cos_sin_cache(config, cfg.head_dim, max_positions)
        self.register_buffer("cos_sin_cache", cos_sin.to(device=device, dtype=dtype), persistent=False)
        self.lm_head_packed: cpu_linear.PackedWeight | None = None
        self.decode_stack: DecodeStack | None = None  # all-decode steps' layers in one native call (CPU)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H] (normed)."""
        hidden = self._embed(input_ids)  # [T, H]
        native = None if self.decode_stack is None else self.decode_stack.run(hidden, positions, kv_caches, meta,
                                                                             self.cos_sin_cache)
        if native is not None:
            hidden, residual = native
        else:
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta, self.cos_sin_cache)
        hidden, _ = self.ops.rms_norm(hidden, self.norm, self.arch.eps, residual)
        return hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, H]; vocab-parallel: each rank looks up the ids in its shard, zeros the rest, and the
        ranks' rows are summed."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_first
        outside = (local < 0) | (local >= self.embed.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V] (under tensor parallelism: on every rank, gathered)."""
        weight = self.embed if self.lm_head is None else self.lm_head
        logits = cpu_linear.linear(hidden, weight, None, self.lm_head_packed, float_out=True)  # [N, V / tp]
        return self.tp.gather_vocab(logits, self.arch.vocab_size)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face tensors (model.layers.N.self_attn.q_proj.weight, ...) into the fused parameters."""
        cfg = self.arch
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        shard = {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, kv), "v_proj": ("qkv", q + kv, kv),
                 "o_proj": ("o", 0, None), "gate_proj": ("gate_up", 0, inter), "up_proj": ("gate_up", inter, inter),
                 "down_proj": ("down", 0, None)}
        norms = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm",
                 "q_norm": "q_norm", "k_norm": "k_norm"}
        expected = {name for name, _ in self.named_parameters()}
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._target(name, shard, norms)
            if target is None:
                if "rotary_emb" in name:
                    continue
                raise ValueError(f"unexpected weight {name!r} for a {self.config.model_type} model")
            param_name, start, size = target
            if param_name not in expected and name.endswith(("o_proj.bias", "down_proj.bias")):
                continue  # a row-parallel bias: rank 0 adds it
            tensor = self._local(name, tensor)
            param = self.get_parameter(param_name)
            if param_name in ("embed", "lm_head"):  # this rank's vocabulary rows; a padded shard's rest is zero
                param.narrow(0, tensor.shape[0], param.shape[0] - tensor.shape[0]).zero_()
                start, size = 0, tensor.shape[0]
            dst = param if size is None else param.narrow(0, start, size)
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, the config implies {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(param_name)
        if self.lm_head is not None and "lm_head" not in loaded and "embed" in loaded:
            self.lm_head.copy_(self.embed)  # untied config but checkpoint without lm_head
            loaded.add("lm_head")
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights for {sorted(missing)[:5]}")

    def pack_weights(self, plan: cpu_linear.LinearPlan | None) -> None:
        """CPU: the matmul weights in the layout of `plan` (the model runner's calibration); None: unpacked."""
        if plan is None:
            return
        for layer in self.layers:
            layer.pack_weights(plan)
        # tied: the embedding stays for the lookup, so the logits take one packed form only (no second copy)
        self.lm_head_packed = (plan.pack(self.embed, one_form=True) if self.lm_head is None
                               else plan.pack(self.lm_head))
        self.decode_stack = DecodeStack.build(self, plan)

    def _local(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a Hugging Face tensor (the whole tensor without tensor parallelism)."""
        tp, cfg = self.tp, self.arch
        if tp.size == 1:
            return tensor
        module, kind = name.split(".")[-2:]
        q, inter = cfg.num_heads * cfg.head_dim, cfg.intermediate_size  # this rank's share
        if module in ("embed_tokens", "lm_head"):
            first, rows, _ = vocab_shard(cfg.vocab_size, tp.rank, tp.size)
            return tensor.narrow(0, first, rows)
        if module == "q_proj":
            return tensor.narrow(0, tp.rank * q, q)
        if module in ("k_proj", "v_proj"):
            kv = cfg.num_kv_heads * cfg.head_dim
            return tensor.narrow(0, first_kv_head(cfg.total_kv_heads, tp.rank, tp.size) * cfg.head_dim, kv)
        if module in ("gate_proj", "up_proj"):
            return tensor.narrow(0, tp.rank * inter, inter)
        if module == "o_proj" and kind == "weight":
            return tensor.narrow(1, tp.rank * q, q)
        if module == "down_proj" and kind == "weight":
            return tensor.narrow(1, tp.rank * inter, inter)
        return tensor

    @staticmethod
    def _target(name: str, shard: dict, norms: dict) -> tuple[str, int, int | None] | None:
        if name == "model.embed_tokens.weight":
            return "embed", 0, None
        if name == "model.norm.weight":
            return "norm", 0, None
        if name == "lm_head.weight":
            return "lm_head", 0, None
        parts = name.split(".")  # model.layers.{i}.{self_attn|mlp|...}.{proj}.{weight|bias}
        if len(parts) < 5 or parts[:2] != ["model", "layers"]:
            return None
        layer, module, kind = parts[2], parts[-2], parts[-1]
        if module in norms:
            return f"layers.{layer}.{norms[module]}", 0, None
        if module in shard:
            fused, start, size = shard[module]
            return f"layers.{layer}.{fused}_{kind}", start, size
        return None
