"""Tiny random-weight checkpoints (hidden 64, 2 layers) saved the way users ship models: a Hugging Face
directory with config.json, safetensors weights and the default model's real tokenizer.

`make_tiny_model(kind, out_dir)` is what tests/conftest.py's fixtures call; other tiers may call it too.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = ("llama", "qwen2", "qwen3", "mistral")


@functools.lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer (from its GGUF, through the loader's de-quantized cache)."""
    from gpu_worker.executor.model_loader import load_model_files

    return load_model_files("smollm2").tokenizer


def tiny_config(kind: str, vocab_size: int, **overrides):
    """A transformers config for a tiny model of `kind` (GQA: 4 query heads over 2 KV heads)."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "llama":  # tied embeddings and llama3 rope scaling, like SmolLM2 / Llama 3.2
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    elif kind == "qwen2":  # qkv bias, untied lm_head
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    elif kind == "qwen3":  # q/k norm, explicit head_dim different from hidden / heads
        cfg = transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, use_sliding_window=False)
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; one of {KINDS}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def make_tiny_model(kind: str, out_dir: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Build a random-weight `kind` model, save it (safetensors) with the tokenizer into out_dir."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.bench.tp_check import randomize

    out = Path(out_dir)
    tok = default_tokenizer()
    cfg = tiny_config(kind, vocab_size=len(tok), **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Per-prompt Hugging Face generate (no padding), greedy, exactly max_tokens: (token ids, chosen-token
    logprobs) of each prompt: what the engine's greedy output must equal."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                               do_sample=False, output_logits=True, return_dict_in_generate=True,
                               pad_token_id=model.config.eos_token_id)
            ids = g.sequences[0, len(p):].tolist()
            lps = torch.stack(g.logits)[:, 0].float().log_softmax(-1)
            results.append((ids, [lps[i, t].item() for i, t in enumerate(ids)]))
    return results
