"""Structured outputs (vLLM's; OpenAI's response_format): decoding constrained to a JSON schema, any JSON, a
regex, one of a list of strings, or an EBNF grammar, through xgrammar (the library vLLM uses by default).

Grammars compiles a request's spec once per worker (cached by its text) against this model's tokenizer. Each
sequence gets a Constraint (a grammar matcher): before a step's sampling, `mask` sets the logits of the tokens
the grammar forbids next to -inf; after it, the sampled token is accepted. A matcher follows the sequence's
tokens, not its KV cache: preemption changes nothing, and a resumed sequence replays the tokens it already
had. When the grammar is complete only the stop tokens are allowed, so the sequence ends with "stop" (with
ignore_eos, the engine ends it there; min_tokens does not hold it open). JSON comes compact (no whitespace
between tokens of the syntax): a model may otherwise emit whitespace until max_tokens, as vLLM's
disable_any_whitespace avoids.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import torch

CACHE_SIZE = 128  # compiled grammars kept per worker


class GrammarError(ValueError):
    """A spec that does not compile (an unsupported schema, a bad regex or grammar): the request's fault."""


def _clean(e: Exception) -> str:
    """xgrammar's message without its C++ location prefix."""
    text = str(e).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?", "", text)
    return text.splitlines()[0] if text else type(e).__name__


def _choice_grammar(choices: list[str]) -> str:
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, stop_token_ids
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # the worker's intake thread compiles ahead of its main thread

    def _compiler_once(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr  # imported on the first structured request: ~0.3 s

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, spec: dict[str, Any]) -> Any:
        """A checked spec (SamplingParams.structured_outputs) -> xgrammar's compiled grammar; GrammarError."""
        kind, value = next(iter(spec.items()))
        key = (kind, value if isinstance(value, str) else "\x00".join(value) if kind == "choice" else "")
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiler = self._compiler_once()
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(value, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(value)
            elif kind == "choice":
                compiled = compiler.compile_grammar(_choice_grammar(value))
            else:
                compiled = compiler.compile_grammar(value)
        except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError for every kind of bad input)
            raise GrammarError(f"structured_outputs.{kind}: does not compile: {_clean(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, compiled: Any, tokens: list[int]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        for t in tokens:  # a resumed sequence: the tokens it had (they were accepted then)
            if not self.matcher.accept_token(t):
                raise GrammarError(f"structured_outputs: the resumed token {t} does not fit the grammar")

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise GrammarError(f"structured_outputs: token {token} does not fit the grammar")

    @property
    def done(self) -> bool:
        """The grammar is complete (and its stop token accepted): nothing may follow."""
        return self.matcher.is_terminated()


@torch.inference_mode()
def mask(logits: torch.Tensor, rows: list[tuple[int, Constraint]]) -> dict[int, str | None]:
    """Set logits[row] to -inf where the row's grammar forbids the next token (in place; logits: [N, V] float32
    on the CPU or a GPU). -> the rows that cannot take a token (left unmasked): None for a grammar that is complete
    but has no stop token to end on (the engine ends it with "stop"), else why it cannot go on (the request's
    error: a grammar with a dead end, or one that failed)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(logits), logits.shape[1])  # [N, ceil(V / 32)] int32, all allowed
    failed: dict[int, str | None] = {}
    for row, c in rows:
        try:
            c.matcher.fill_next_token_bitmask(bitmask, row)
        except Exception as e:  # noqa: BLE001 (this request's grammar alone)
            failed[row] = f"structured_outputs: the grammar failed: {_clean(e)}"
            continue
        if not bool(bitmask[row].any()):  # nothing allowed: sampling would pick a token the grammar refuses
            failed[row] = None if c.matcher.is_completed() else (
                "structured_outputs: the grammar allows no token of this model's vocabulary here (a dead end)")
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[row for row, _ in rows if row not in failed])
    return failed
