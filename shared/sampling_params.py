"""SamplingParams: how one request is sampled. Shared by the engine, the gateway and Celery (no torch).

The limits below bound every field, so no value can overflow a tensor or a generator in the engine; the
gateway's request models (gateway.openai_api, gateway.chat_api) use the same numbers, and checks that need the
model (top_k and token ids against the vocabulary) happen where the tokenizer is known (gateway.prompts)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit seed, as vLLM takes (torch.Generator.manual_seed)
MAX_N = 64  # choices per request
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit)
MAX_STOP = 16  # stop strings (OpenAI allows 4, vLLM any number)
MAX_STOP_LEN = 256  # characters per stop string: the detokenizer holds back up to this many
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # token ids in one logit_bias (OpenAI's limit)
LOGIT_BIAS_MIN, LOGIT_BIAS_MAX = -100.0, 100.0
MIN_TEMPERATURE = 0.01  # a smaller positive temperature samples as this one (vLLM's rule): logits / 1e-300 are inf
# structured outputs (vLLM's StructuredOutputsParams): exactly one of these kinds
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 32768  # a JSON schema, regex, grammar or all the choices together: compiling costs with the size
MAX_CHOICES = 256


def structured_error(spec: Any) -> str | None:
    """What is wrong with a structured-outputs spec ("<field>: <rule>", the field under structured_outputs), or
    None. The grammar itself is compiled by the worker, which answers one that does not compile with a 400."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in STRUCTURED_KINDS:
        return f": must be an object with exactly one of {', '.join(STRUCTURED_KINDS)}"
    kind, value = next(iter(spec.items()))
    if kind == "json_object":
        return None if value is True else ".json_object: must be true"
    if kind == "choice":
        if (not isinstance(value, list) or not 1 <= len(value) <= MAX_CHOICES
                or any(not isinstance(c, str) or not c for c in value)):
            return f".choice: must be a list of 1 to {MAX_CHOICES} non-empty strings"
        size = sum(len(c) for c in value)
    elif kind == "json":
        if isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            return ".json: must be a JSON schema (an object, or its JSON text)"
        try:
            if not isinstance(json.loads(value), dict | bool):
                return ".json: must be a JSON schema (an object, or its JSON text)"
        except ValueError as e:
            return f".json: is not valid JSON ({e})"
        size = len(value)
    else:
        if not isinstance(value, str) or not value:
            return f".{kind}: must be a non-empty string"
        size = len(value)
    return None if size <= MAX_GRAMMAR_CHARS else f".{kind}: at most {MAX_GRAMMAR_CHARS} characters, got {size}"


def _token_key(key: Any) -> Any:
    """A logit_bias key as an int token id ("42" -> 42); anything else is left for _validate to refuse."""
    if isinstance(key, str) and key.isdigit() and len(key) <= 10:
        return int(key)
    return key


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token besides the chosen one
    # the prompt's logprobs too (vLLM's prompt_logprobs: each prompt token's given what precedes it, plus the
    # top N there; the first token has none), with the first output token. OpenAI's echo + logprobs.
    prompt_logprobs: int | None = None
    # constrained decoding (vLLM's structured outputs; OpenAI's response_format): one of {"json": schema (text or
    # object)}, {"json_object": True}, {"regex": str}, {"choice": [str, ...]}, {"grammar": EBNF str}
    structured_outputs: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:  # JSON object keys arrive as strings
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()} or None
        if self.top_k == -1:
            self.top_k = 0
        spec = self.structured_outputs
        if isinstance(spec, dict) and isinstance(spec.get("json"), dict):  # one form: the schema's JSON text
            self.structured_outputs = {"json": json.dumps(spec["json"], separators=(",", ":"))}
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        def is_int(v: Any, lo: int, hi: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        def in_range(v: Any, lo: float, hi: float) -> bool:
            if isinstance(v, bool) or not isinstance(v, int | float) or abs(v) > 1e300:
                return False
            return math.isfinite(v) and lo <= v <= hi

        if not is_int(self.n, 1, MAX_N):
            raise bad("n", f"must be an integer in [1, {MAX_N}]")
        if not in_range(self.temperature, 0, math.inf):
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not in_range(self.top_p, 0, 1) or self.top_p == 0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k, 0, INT32_MAX):
            raise bad("top_k", "must be -1 or 0 (off) or an integer in [1, the vocabulary size]")
        if not in_range(self.min_p, 0, 1):
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and not is_int(self.max_tokens, 1, INT32_MAX):
            raise bad("max_tokens", f"must be an integer in [1, {INT32_MAX}]")
        if not is_int(self.min_tokens, 0, INT32_MAX):
            raise bad("min_tokens", f"must be an integer in [0, {INT32_MAX}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")
        if self.logprobs is not None and not is_int(self.logprobs, 0, MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not is_int(self.prompt_logprobs, 0, MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.structured_outputs is not None and (why := structured_error(self.structured_outputs)) is not None:
            raise ValueError(f"structured_outputs{why}")
        if not in_range(self.presence_penalty, -2, 2):
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not in_range(self.frequency_penalty, -2, 2):
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not in_range(self.repetition_penalty, 0, 10) or self.repetition_penalty == 0:
            raise bad("repetition_penalty", "must be in (0, 10]")
        if self.seed is not None and not is_int(self.seed, SEED_MIN, SEED_MAX):
            raise bad("seed", f"must be a signed 64-bit integer, in [{SEED_MIN}, {SEED_MAX}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP:
            raise ValueError(f"stop allows at most {MAX_STOP} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_LEN for s in self.stop):
            raise ValueError(f"stop strings may have at most {MAX_STOP_LEN} characters, got "
                             f"{max(len(s) for s in self.stop)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not is_int(t, 0, INT32_MAX) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids (integers >= 0 in the vocabulary)")

        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias allows at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
        if any(not is_int(t, 0, INT32_MAX) for t in bias):
            raise bad("logit_bias", "keys must be token ids (integers >= 0 in the vocabulary)")
        if any(not in_range(v, LOGIT_BIAS_MIN, LOGIT_BIAS_MAX) for v in bias.values()):
            raise bad("logit_bias", f"values must be numbers in [{LOGIT_BIAS_MIN:g}, {LOGIT_BIAS_MAX:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """A plain copy, its lists and dict copied too (what asdict gives, without its deep recursion: that
        cost a gateway ~0.1 ms per request)."""
        d = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        d["stop"], d["stop_token_ids"] = list(self.stop or []), list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            d["logit_bias"] = dict(self.logit_bias)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**{k: v for k, v in d.items() if not k.startswith("_")})
