"""The gateway's tokenizers: only the tokenizer of each served model (never its weights), loaded once in a
thread, so the gateway knows a prompt's length in tokens (and KV blocks) before it routes. Tokenizing runs
in a few threads of its own (`tokenizer_threads`), never on the event loop: a flood of huge prompts waits
for those threads while the loop keeps relaying other requests' tokens."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("kvfleet.gateway")
T = TypeVar("T")
# transformers resolves AutoTokenizer through a lazy module: threads importing it at once (several FleetClients
# of one Celery worker loading their tokenizers) can see "cannot import name 'AutoTokenizer'". One at a time.
_TRANSFORMERS_IMPORT = threading.Lock()


def load_tokenizer(model: str) -> Any:
    """`model` is an alias, a Hugging Face directory or a .gguf file (as `kvfleet worker --model` takes). A GGUF's
    tokenizer is read out of it once and kept as a tokenizer directory (`_gguf_tokenizer`)."""
    from shared.models import resolve_model

    path = Path(resolve_model(model))
    return _gguf_tokenizer(path) if path.suffix == ".gguf" else _load_dir(path)


# the classes AutoTokenizer would load as PreTrainedTokenizerFast from tokenizer.json (transformers 5 names it
# TokenizersBackend): loaded as that directly, without AutoTokenizer's imports (torch and the model configs: ~2.7
# of the ~3.6 s of CPU a tokenizer cost a gateway to load on a 2-core Zen 3)
_PLAIN_FAST = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def _load_dir(path: Path) -> Any:
    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    with _TRANSFORMERS_IMPORT:
        if named in _PLAIN_FAST and (path / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast as loader
        else:
            from transformers import AutoTokenizer as loader
    return loader.from_pretrained(path)


def _gguf_tokenizer(gguf: Path) -> Any:
    """The GGUF's tokenizer, from a Hugging Face tokenizer directory in the kvfleet cache, which is read out of the
    GGUF on first use: transformers' GGUF reader parses its vocabulary field by field (~8.7 s of CPU for the default
    model on a 2-core Zen 3), which every gateway start (and restart after a crash) would otherwise pay before
    its first request. Concurrent first uses each read it; the first to finish keeps its copy. A cache that cannot
    be written costs only the speed: the tokenizer read from the GGUF is used."""
    from shared.models import cache_dir, gguf_cache_name, mark_used

    out = cache_dir("tokenizers") / gguf_cache_name(gguf)
    if not (out / "tokenizer_config.json").is_file():
        with _TRANSFORMERS_IMPORT:
            from transformers import AutoTokenizer
        log.info("reading the tokenizer out of %s into %s (once)", gguf, out)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tmp = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
            tokenizer.save_pretrained(tmp)
            tmp.rename(out)
        except OSError as e:  # another process saved it first, or the cache cannot be written
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if not (out / "tokenizer_config.json").is_file():
                log.warning("could not keep the tokenizer of %s in %s (%s); the next start reads it again", gguf,
                            out, e)
                return tokenizer
    mark_used(out)
    return _load_dir(out)


def same_model(name: str, model: str, model_path: str = "") -> bool:
    """Does a request's `model` name the model a worker reports (its name, path, or their base names)?"""
    if not name:
        return False
    names = {model, model_path, os.path.basename(model.rstrip("/")), os.path.basename(model_path.rstrip("/"))}
    if name in names - {""}:
        return True
    return bool(model_path) and resolved_path(name) == model_path


@functools.lru_cache(maxsize=256)
def resolved_path(name: str) -> str | None:
    """The local path an alias or path names (an alias of the default model names its GGUF), or None."""
    from shared.models import ModelNotFound, resolve_model

    try:
        return str(resolve_model(name))
    except (ModelNotFound, OSError):
        return None


class Tokenizers:
    """model path -> tokenizer, each loaded once (concurrent callers share the load); and the threads that
    tokenize (`run`)."""

    def __init__(self, threads: int = 4, chat_template: str = "") -> None:
        """chat_template: Jinja text applied in place of each model's own (--chat-template); "": the model's."""
        if threads < 1:
            raise ValueError(f"tokenizer_threads must be at least 1, got {threads}")
        self._chat_template = chat_template
        self._loads: dict[str, asyncio.Task] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfleet-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any, inline: bool = False) -> T:
        """fn(*args) in a tokenizer thread (at most `threads` at once; the rest wait in line), or here and
        now when `inline` (work shorter than the hop to a thread)."""
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def preload(self, model: str) -> None:
        self._task(model)

    def _task(self, model: str) -> asyncio.Task:
        key = resolved_path(model) or model  # an alias and its path share one load (the gateway preloads by
        # alias; workers report their path)
        task = self._loads.get(key)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._load, model))
            self._loads[key] = task
        return task

    def _load(self, model: str) -> Any:
        tokenizer = load_tokenizer(model)
        if self._chat_template:
            tokenizer.chat_template = self._chat_template
        return tokenizer

    async def get(self, model: str) -> Any:
        return await asyncio.shield(self._task(model))


def tokenizers_for(settings: Any) -> Tokenizers:
    """A gateway's (or a FleetCaller's) Tokenizers, with its --chat-template read (ValueError where it is wrong)."""
    from shared.models import chat_template_text

    template = chat_template_text(settings.chat_template) if settings.chat_template else ""
    return Tokenizers(settings.tokenizer_threads, chat_template=template)


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids, as `tokenizer(prompt)` gives them: through the Rust tokenizer itself where it
    gives the same (special tokens included), skipping transformers' Python wrapper (60 against 100 us for a
    short prompt on a 2-core Zen 3)."""
    encode = _direct_encoders.get(tokenizer, _unchecked)
    if encode is _unchecked:
        encode = _direct_encoders[tokenizer] = _direct_encoder(tokenizer)
    return encode(prompt).ids if encode is not None else list(tokenizer(prompt)["input_ids"])


_direct_encoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its Rust encode, or None
_unchecked = object()
_PROBE = "Hello, world! ünïcödé 漢字 🙂\n  spaced\tout"


def _direct_encoder(tokenizer: Any) -> Callable[[str], Any] | None:
    """The Rust tokenizer's encode, when it gives what the tokenizer's own call does on a probe (a tokenizer
    whose Python side adds or drops tokens keeps its own call)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        same = backend.encode(_PROBE).ids == list(tokenizer(_PROBE)["input_ids"])
    except Exception:  # noqa: BLE001 (any doubt: the tokenizer's own call)
        return None
    return backend.encode if same else None


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
             options: dict[str, Any] | None = None) -> list[int]:
    """The tokenizer's chat template with the assistant's turn opened (and the tools, for a template that shows
    them). options: add_generation_prompt, continue_final_message and the template's own variables
    (ChatCompletionRequest.template_options); default: the turn opened."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use /v1/completions")
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, **(options or {"add_generation_prompt": True}),
                                            **({"tools": tools} if tools else {}))
    except TemplateError as e:  # the template's own checks ("roles must alternate ...")
        raise ValueError(f"the model's chat template refused these messages: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # a message field of a shape the
        # template did not expect (a tool_calls entry, a tool's parameters): the caller's input, not a fault
        raise ValueError(f"the model's chat template could not render these messages or tools: "
                         f"{type(e).__name__}: {e}") from None
    ids = out["input_ids"] if not isinstance(out, list) else out
    return list(ids)


def token_strings(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """What each token reads as, for logprobs (decoded alone, so byte-level markers become text)."""
    return [tokenizer.decode([t]) for t in token_ids]
