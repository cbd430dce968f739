"""Find a model (alias, Hugging Face directory or .gguf file) and read its config, tokenizer and weights.

Weights come from safetensors (one file or shards listed in model.safetensors.index.json) or from a GGUF
file through transformers' GGUF loader (de-quantized to dense tensors). Nothing is fetched from a hub.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.models import ModelNotFound, cache_dir, gguf_cache_name, mark_used, resolve_model
from shared.settings import hf_offline

hf_offline()  # before transformers is imported: nothing is ever fetched from a hub

log = logging.getLogger(__name__)

# model_type -> the architecture name Hugging Face uses; all run through gpu_worker/models/llama.py
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedArchitecture(ValueError):
    pass


def _check_architecture(config: Any, source: Path) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        archs = getattr(config, "architectures", None) or [model_type]
        supported = ", ".join(f"{a} ({t})" for t, a in SUPPORTED_ARCHITECTURES.items())
        raise UnsupportedArchitecture(
            f"{source}: architecture {archs[0]} (model_type {model_type!r}) is not supported; "
            f"kvfleet runs: {supported}")


@dataclass
class ModelFiles:
    """What the engine needs from a checkpoint; `weights()` yields (Hugging Face name, tensor)."""

    path: Path
    config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers tokenizer

    weights_dir: Path  # the safetensors directory read (for a GGUF: its de-quantized copy in the cache)

    def weights(self) -> Iterator[tuple[str, Any]]:
        return _safetensors_weights(self.weights_dir)


def load_model_files(name: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> ModelFiles:
    """Resolve `name` and read its config and tokenizer. A GGUF is de-quantized once (transformers' loader,
    ~30 s) into a float32 safetensors directory under cache_root (default ~/.cache/kvfleet), so later loads
    take about a second."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model(name)
    weights_dir = model_dir(name, cache_root)
    config = AutoConfig.from_pretrained(weights_dir)
    _check_architecture(config, path)
    tokenizer = AutoTokenizer.from_pretrained(weights_dir)
    return ModelFiles(path=path, config=config, tokenizer=tokenizer, weights_dir=weights_dir)


def model_dir(name: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> Path:
    """The directory with `name`'s config.json, tokenizer and safetensors: the model's own, or a GGUF's
    de-quantized copy (made on first use)."""
    path = resolve_model(name)
    return _gguf_as_safetensors(path, cache_root) if path.suffix == ".gguf" else path


def checked_max_model_len(config: Any, max_model_len: int | None) -> int:
    """The context window asked for (default: the model's), checked against the model's config."""
    window = config.max_position_embeddings
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        window = min(window, config.sliding_window)  # no sliding-window attention: stay inside it
    if max_model_len is None:
        return window
    if max_model_len > window:
        raise ValueError(f"max_model_len {max_model_len} > the model's context window {window}")
    return max_model_len


def eos_token_ids(config: Any, tokenizer: Any) -> list[int]:
    """The tokenizer's EOS id first, then any other end-of-text ids the config names (Llama 3)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    cfg_eos = getattr(config, "eos_token_id", None)
    for e in (cfg_eos if isinstance(cfg_eos, list) else [cfg_eos]):
        if e is not None and e not in eos:
            eos.append(e)
    return eos


def _safetensors_weights(model_dir: Path) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFound(f"{model_dir} has no *.safetensors weights (only safetensors and GGUF are read)")
    for file in files:
        with safe_open(model_dir / file, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _gguf_as_safetensors(gguf: Path, cache_root: str | os.PathLike | None) -> Path:
    """The GGUF's de-quantized float32 copy (config.json, model.safetensors, tokenizer), made on first use
    (one process converts while the others wait on a file lock)."""
    root = cache_dir("gguf", cache_root)
    out = root / gguf_cache_name(gguf)
    if (out / "model.safetensors").is_file():
        mark_used(out)
        return out
    with open(root / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            _convert_gguf(gguf, out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _check_architecture(config, gguf)  # before the slow part
    log.info("de-quantizing %s through transformers' GGUF loader into %s (once)", gguf, out)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shares the embedding's storage
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    tmp.chmod(0o755)
    config.dtype = torch.float32
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": str(gguf)})
    shutil.rmtree(out, ignore_errors=True)  # a partial copy left by a crash
    tmp.rename(out)
