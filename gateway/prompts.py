"""An OpenAI request body -> what enters the fleet: each prompt's token ids (a completion's text or token ids,
one prompt or a batch of them; a chat's messages through the model's chat template), checked against the
context window, and its sampling params.

The gateway's endpoints and services.fleet_calls (Celery tasks, the Python client, batch files) both prepare
requests here, so a request is read the same whichever door it comes in by. Nothing here imports FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.chat_api import ChatCompletionRequest, TokenizeRequest
from gateway.errors import bad_request, param_of
from gateway.openai_api import CompletionRequest, DetokenizeRequest
from gateway.response_models import DetokenizeResponse, TokenizeResponse
from gateway.tokenizer import chat_ids, prompt_ids
from shared.sampling_params import SamplingParams

MAX_BATCH_PROMPTS = 256  # prompts in one /v1/completions request (each becomes its own fleet request)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # the text, when the caller sent text (echo)
    params: SamplingParams  # max_tokens resolved against this prompt's length


@dataclass
class Prepared:
    prompts: list[Prompt]  # a completion: one per prompt of its batch; a chat: one
    logprobs: int | None  # completion: logprobs; chat: top_logprobs; None: off
    echo: bool
    priority: int
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs as asked (top N); None: off


def is_batch(prompt: Any) -> bool:
    """A list of prompts (texts or token-id lists), rather than one prompt (a text or a token-id list)?"""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


def prompt_count(prompt: Any) -> int:
    return len(prompt) if is_batch(prompt) else 1


def part_ids(request_id: str, count: int) -> list[str]:
    """The fleet request ids of a batch's prompts: the response's own id when there is one prompt, else
    `{request_id}-{i}` (so a retry under the same id finds each prompt's job again)."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


def completion_prompts(tokenizer: Any, prompt: Any) -> list[tuple[list[int], str | None]]:
    """A completion's prompt (text, token ids, or a batch of either) -> [(token ids, text or None)]."""
    batch = prompt if is_batch(prompt) else [prompt]
    if len(batch) > MAX_BATCH_PROMPTS:
        raise bad_request(f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request, got {len(batch)}", "prompt")
    vocab = len(tokenizer)
    out: list[tuple[list[int], str | None]] = []
    for p in batch:
        if isinstance(p, str):
            out.append((prompt_ids(tokenizer, p), p))
            continue
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", "prompt")
        out.append((list(p), None))
    return out


def resolve_max_tokens(target: Any, prompt_len: int, max_tokens: int | None, param: str) -> int | None:
    """max_tokens as the workers will run it; 400 (with both numbers) when prompt + output exceed the window.
    With no worker alive (scale to zero) the window is unknown: the worker that takes it checks.
    `target`: a gateway.targets.Target."""
    if not target.workers:
        return max_tokens
    limit = target.max_model_len
    if max_tokens is None:
        if prompt_len >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt is "
                              f"{prompt_len} tokens, leaving no room for output.", param, "context_length_exceeded")
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion "
            f"(max_tokens)). Please reduce the length of the prompt or max_tokens.", param,
            "context_length_exceeded")
    return max_tokens


def make_params(build: Any) -> SamplingParams:
    try:
        return build()
    except ValueError as e:
        raise bad_request(str(e), param_of(str(e)), "invalid_value") from None


def check_vocab(body: CompletionRequest | ChatCompletionRequest, vocab: int) -> None:
    """The fields that name tokens or count them, against the model's vocabulary: 400 naming the field."""
    if body.top_k > vocab:
        raise bad_request(f"top_k: must be -1 or 0 (off) or in [1, {vocab}] (the model's vocabulary size), got "
                          f"{body.top_k}", "top_k", "invalid_value")
    for i, t in enumerate(body.stop_token_ids or []):
        if t >= vocab:
            raise bad_request(f"stop_token_ids[{i}]: token ids must be in [0, {vocab}) (the model's vocabulary), "
                              f"got {t}", f"stop_token_ids[{i}]", "invalid_value")
    for key in body.logit_bias or {}:
        if int(key) >= vocab:
            raise bad_request(f"logit_bias.{key}: token ids must be in [0, {vocab}) (the model's vocabulary)",
                              f"logit_bias.{key}", "invalid_value")


SHORT_INPUT_CHARS = 2048  # inputs up to this long are tokenized on the event loop (see is_short)


def is_short(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """Is the input short enough to tokenize on the event loop? Up to SHORT_INPUT_CHARS characters take
    well under a millisecond, less than the hop to a tokenizer thread and back (and its GIL handovers)."""
    if isinstance(body, ChatCompletionRequest):
        pieces = [m.content if isinstance(m.content, str) else [p.text for p in m.content or []]
                  for m in body.messages]
    else:
        pieces = [body.prompt]
    total = 0
    for piece in pieces:
        total += len(piece) if isinstance(piece, str) else sum(len(x) for x in piece if isinstance(x, str))
    return total <= SHORT_INPUT_CHARS


def prepare(target: Any, body: CompletionRequest | ChatCompletionRequest) -> Prepared:
    """Check against the vocabulary, tokenize, check the window, build the sampling params: what every door does
    before placing. 400s name the field. `target`: the gateway.targets.Target the request goes to (its
    tokenizer and window). It tokenizes: callers on an event loop run it in the tokenizer threads
    (gateway.tokenizer.Tokenizers.run) unless the input `is_short`."""
    tok = target.tokenizer
    check_vocab(body, len(tok))
    if isinstance(body, ChatCompletionRequest):
        ids = _chat_ids(tok, body)
        inputs: list[tuple[list[int], str | None]] = [(ids, None)]
        wanted, param, echo = body.max_completion_tokens or body.max_tokens, "messages", False
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        inputs = completion_prompts(tok, body.prompt)
        wanted, param, echo, logprobs = body.max_tokens, "prompt", body.echo, body.logprobs
        if echo:  # token ids are echoed as their text
            inputs = [(ids, tok.decode(ids) if text is None else text) for ids, text in inputs]
    # the prompt's logprobs: vLLM's prompt_logprobs, or echo + logprobs (OpenAI's legacy completions; how lm-eval
    # scores text); with both, the larger top N (each answer shows its own)
    asked = [v for v in (body.prompt_logprobs, logprobs if echo else None) if v is not None]
    prompt_logprobs = max(asked) if asked else None
    prompts = []
    for ids, text in inputs:
        max_tokens = resolve_max_tokens(target, len(ids), wanted, param)
        prompts.append(Prompt(ids, text, make_params(
            lambda m=max_tokens: body.sampling_params(m, logprobs, prompt_logprobs))))
    return Prepared(prompts, logprobs, echo, body.priority, body.prompt_logprobs)


def _chat_ids(tok: Any, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """A chat's messages through the chat template, with its tools and template options; 400 naming messages when
    the template cannot render them."""
    try:
        return chat_ids(tok, [m.as_template_input() for m in body.messages], body.template_tools(),
                        body.template_options())
    except ValueError as e:
        raise bad_request(str(e), "messages") from None


def tokenize(target: Any, body: TokenizeRequest) -> TokenizeResponse:
    """vLLM's /tokenize: the token ids a prompt or chat messages become (what /v1/completions and
    /v1/chat/completions would run), and the model's window. It tokenizes (see `prepare`)."""
    tok = target.tokenizer
    if body.messages is None:
        ids = (prompt_ids(tok, body.prompt) if body.add_special_tokens is not False
               else tok(body.prompt, add_special_tokens=False)["input_ids"])
    else:
        ids = _chat_ids(tok, body)
        if body.add_special_tokens:  # the rendered text tokenized again, with the tokenizer's own special tokens
            ids = tok(tok.decode(ids), add_special_tokens=True)["input_ids"]
    ids = list(ids)
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=target.max_model_len, tokens=ids, token_strs=strs)


def detokenize(target: Any, body: DetokenizeRequest) -> DetokenizeResponse:
    """vLLM's /detokenize: token ids (each in the vocabulary: a 400 naming the first that is not) to text."""
    vocab = len(target.tokenizer)
    for i, t in enumerate(body.tokens):
        if t >= vocab:
            raise bad_request(f"tokens[{i}]: token ids must be in [0, {vocab}) (the model's vocabulary), got {t}",
                              f"tokens[{i}]", "invalid_value")
    return DetokenizeResponse(prompt=target.tokenizer.decode(body.tokens))
