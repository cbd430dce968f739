"""OpenAI-shaped request models: the sampling fields /v1/completions and /v1/chat/completions share, with
vLLM's extra ones (top_k, min_p, priority, ...), and the completion and /detokenize requests. The chat request
(messages, tools, template controls) is gateway.chat_api's; the response bodies are gateway.response_models'.
Field limits live here (the numbers in shared.sampling_params), so a bad value gets a 400 that names the field
and the limit; gateway.prompts checks what needs the model (top_k, stop_token_ids and logit_bias keys against
the vocabulary)."""

from __future__ import annotations

import logging
import re
import types
from functools import cache
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from shared.sampling_params import (
    INT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_STOP_TOKEN_IDS,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    structured_error,
)

log = logging.getLogger("kvfleet.gateway")

PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # a signed 32-bit integer; lower runs first
_SURROGATE = re.compile("[\ud800-\udfff]")
_IGNORED_LOGGED: set[str] = set()  # request fields this process warned it ignores (each once)
MAX_IGNORED_LOGGED = 256  # names are the clients' to choose: the set stays small


def invalid(param: str, message: str) -> PydanticCustomError:
    """A validation error for `param`, a path below the field it is raised in ("[1].type"), or a whole path
    when raised for the body: gateway.errors.validation_error puts it together."""
    return PydanticCustomError("invalid_value", "{message}", {"message": message, "at": param})


def lone_surrogate_path(value: Any) -> str | None:
    """The path ("messages[0].content") of the first string (or key) in a JSON value that holds a lone UTF-16
    surrogate ("\\ud800" in JSON): no tokenizer or encoder can take one. Iterative: any nesting depth."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(k, str) and _SURROGATE.search(k):
                    return sub
                todo.append((sub, item))
        elif isinstance(v, list):  # (a prompt of token ids: no path string per id)
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(v) if isinstance(item, str | dict | list))
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, every chunk carries its "
                                                            "choice's usage so far")

    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")  # `true`: any JSON value
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise invalid("json_schema", "is required when type is \"json_schema\"")
        return self


# vLLM's ways to ask for structured outputs besides response_format, and the kind each is
STRUCTURED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                     "guided_grammar": "grammar"}


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="-1 or 0: off; else at most the vocabulary size")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="a signed 64-bit integer")
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOP} strings of 1 to {MAX_STOP_LEN} characters")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    logit_bias: dict[str, float] | None = Field(
        None, description=f"token id -> bias in [-100, 100] added to its logit before sampling, up to {MAX_LOGIT_BIAS} ids")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX,
                          description="a signed 32-bit integer; under the worker's priority scheduling policy "
                                      "lower values run first (ignored by fcfs and sjf)")
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: exactly one of json (a schema), json_object (true), regex, choice (strings), "
                          "grammar (EBNF); or its older guided_json, guided_regex, guided_choice, guided_grammar")
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM's: each prompt token's logprob, rank and the top N there, in "
                                                 "the choices' `prompt_logprobs` (the first token's null); not with "
                                                 "stream")

    def structured_spec(self) -> tuple[str, dict[str, Any]] | None:
        """(the field that asked, SamplingParams.structured_outputs) or None; see _one_structured_field."""
        if self.structured_outputs is not None:
            return "structured_outputs", self.structured_outputs
        for field, kind in STRUCTURED_FIELDS.items():
            value = getattr(self, field)
            if value is not None:
                return field, {kind: value}
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return "response_format", {"json_object": True}
        schema = rf.json_schema.schema_
        return "response_format.json_schema.schema", {"json": {} if schema is True else schema}

    @model_validator(mode="after")
    def _one_structured_field(self) -> Any:
        """At most one way of asking (response_format other than text counts), and that one well-formed."""
        asked = [f for f in ("structured_outputs", *STRUCTURED_FIELDS) if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            asked.append("response_format")
        if len(asked) > 1:
            raise invalid(asked[1], f"only one of {', '.join(asked)} may be given")
        spec = self.structured_spec()
        if spec is not None:
            field, value = spec
            why = structured_error(value)  # ".kind: rule" or ": rule"
            if why is not None:
                below, rule = why.split(": ", 1)
                raise invalid(field + below if field == "structured_outputs" else field, rule)
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> Any:
        if self.prompt_logprobs is not None and self.stream:
            raise invalid("prompt_logprobs", "is not available with stream: true (as in vLLM); ask without "
                                             "streaming, or use echo with logprobs on /v1/completions")
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _warn_ignored_fields(cls, data: Any, handler: Any) -> Any:
        """Fields this API does not know are ignored, as vLLM and OpenAI's clients expect (a newer client's field,
        a provider's extension), and named in a warning, each once per process (vLLM warns on every request)."""
        result = handler(data)
        if isinstance(data, dict) and len(_IGNORED_LOGGED) < MAX_IGNORED_LOGGED:
            new = sorted(str(k) for k in data.keys() - cls.model_fields.keys() - _IGNORED_LOGGED)
            if new:
                _IGNORED_LOGGED.update(new)
                log.warning("%s: ignoring field(s) this API does not know: %s (each named once)", cls.__name__,
                            ", ".join(new[:20]))
        return result

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A null for a field with a default that is not itself null (temperature, top_p, n, stream, ...) means
        that default, as in OpenAI's API, where those fields are "number or null" (LangChain and other clients send
        `"temperature": null` for "not set"). A field whose default is null keeps its null (max_tokens: up to the
        context window); a required one (model, prompt, messages) is still refused."""
        if isinstance(data, dict) and None in data.values():
            defaulted = _null_means_default(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any, info: ValidationInfo) -> Any:
        if info.mode == "json":  # pydantic's JSON parser refuses a lone surrogate itself (the fast lane then
            return data  # hands the body to the app, whose json.loads takes it, and this names the field)
        path = lone_surrogate_path(data)
        if path is not None:
            raise invalid(path, "contains a lone UTF-16 surrogate (such as \\ud800), which is not valid "
                                "Unicode text")
        return data

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP:
            raise invalid("", f"at most {MAX_STOP} stop strings, got {len(strings)}")
        for i, s in enumerate(strings):
            at = f"[{i}]" if isinstance(stop, list) else ""
            if not 1 <= len(s) <= MAX_STOP_LEN:
                raise invalid(at, f"a stop string must have 1 to {MAX_STOP_LEN} characters, got {len(s)}")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_limits(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise invalid("", f"at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
        for key, value in bias.items():
            if not key.isdigit() or int(key) > INT32_MAX:
                raise invalid(f".{key}", f"keys must be token ids (integers >= 0 as strings), got {key!r}")
            if not -100 <= value <= 100:
                raise invalid(f".{key}", f"a bias must be in [-100, 100], got {value!r}")
        return bias

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured_outputs=(spec := self.structured_spec()) and spec[1],
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None)


@cache
def _null_means_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` that have a default and whose type does not take None (SamplingFields'
    _null_is_the_default)."""
    return frozenset(name for name, f in model.model_fields.items()
                     if not f.is_required() and f.annotation is not Any and types.NoneType not in get_args(f.annotation)
                     and f.annotation is not types.NoneType)


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only best_of == n (kvfleet does not rank)")
    echo: bool = Field(False, description="the prompt before the completion; with logprobs, the prompt tokens' "
                                          "logprobs too (the first is null), as OpenAI's legacy completions")
    suffix: str | None = Field(None, description="not supported: a non-empty suffix is a 400 (as in vLLM)")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise invalid("", "is not supported: kvfleet completes the prompt left to right (inserting before a "
                              "suffix needs a fill-in-the-middle prompt format; vLLM refuses it as well); put "
                              "the text in the prompt, or send no suffix")
        return suffix

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of", f"must equal n ({self.n}): kvfleet returns every sequence it samples and "
                                     f"does not rank candidates, got {self.best_of}")
        return self



class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    tokens: list[TokenId] = Field(max_length=1 << 20)

