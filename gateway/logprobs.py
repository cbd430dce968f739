"""Tokens' logprobs as the responses show them: OpenAI's completion and chat shapes (the sampled tokens', and the
prompt's for an echoed completion) and vLLM's prompt_logprobs. The worker sends per token a dict of token id ->
logprob (the token's own and the top N there); here they become token strings, offsets and ranks."""

from __future__ import annotations

from typing import Any

from gateway.response_models import ChatLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob
from gateway.tokenizer import token_strings
from shared.messages import LOGPROB_FLOOR


def _ranked(lp: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])


def completion_logprobs(tok: Any, token_ids: list[int], lps: list[dict[int, float]], offset: int
                        ) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for t, s, lp in zip(token_ids, token_strings(tok, token_ids), lps, strict=False):
        out.tokens.append(s)
        out.token_logprobs.append(lp.get(t))
        ranked = _ranked(lp)
        names = token_strings(tok, [k for k, _ in ranked])
        out.top_logprobs.append({name: v for name, (_, v) in zip(names, ranked, strict=True)})
        out.text_offset.append(offset)
        offset += len(s)
    return out


def _prompt_entries(prompt_ids: list[int], lps: list[dict[int, float] | None] | None
                    ) -> list[dict[int, float] | None]:
    """The worker's prompt logprobs, one per prompt token (all None when missing: never a wrong length)."""
    return lps if lps is not None and len(lps) == len(prompt_ids) else [None] * len(prompt_ids)


def _with_top(entry: dict[int, float], token: int, top_n: int) -> list[tuple[int, float]]:
    """`token` and the top_n likeliest of an entry (the worker may have scored more, for another answer)."""
    ranked = _ranked(entry)[:top_n]
    return ranked if any(k == token for k, _ in ranked) else [(token, entry[token])] + ranked


def prompt_logprobs(tok: Any, prompt_ids: list[int], lps: list[dict[int, float] | None] | None, top_n: int
                    ) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs: each prompt token with its logprob and the top_n
    there; the first token has none (null), as in OpenAI's legacy completions and vLLM's."""
    out = CompletionLogprobs()
    offset = 0
    for t, s, lp in zip(prompt_ids, token_strings(tok, prompt_ids), _prompt_entries(prompt_ids, lps), strict=True):
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(lp.get(t))
        kept = _with_top(lp, t, top_n)
        names = token_strings(tok, [k for k, _ in kept])
        out.top_logprobs.append({name: v for name, (_, v) in zip(names, kept, strict=True)})
    return out


def vllm_prompt_logprobs(tok: Any, prompt_ids: list[int], lps: list[dict[int, float] | None] | None,
                         ranks: list[int | None] | None, top_n: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token {token id: logprob, rank, decoded token} for the prompt's token
    and the top_n there (ranks 1..top_n); the first None."""
    ranks = ranks if ranks is not None and len(ranks) == len(prompt_ids) else [None] * len(prompt_ids)
    out: list[dict[str, PromptLogprob] | None] = []
    for t, lp, rank in zip(prompt_ids, _prompt_entries(prompt_ids, lps), ranks, strict=True):
        if lp is None:
            out.append(None)
            continue
        top = _ranked(lp)[:top_n]
        names = token_strings(tok, [t] + [k for k, _ in top])
        entry = {str(t): PromptLogprob(logprob=lp[t], rank=rank, decoded_token=names[0])}
        for i, ((k, v), name) in enumerate(zip(top, names[1:], strict=True)):
            entry.setdefault(str(k), PromptLogprob(logprob=v, rank=i + 1, decoded_token=name))
        out.append(entry)
    return out


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=first.tokens + then.tokens,
                              token_logprobs=first.token_logprobs + then.token_logprobs,
                              top_logprobs=first.top_logprobs + then.top_logprobs,
                              text_offset=first.text_offset + then.text_offset)


def chat_logprobs(tok: Any, token_ids: list[int], lps: list[dict[int, float]], top_n: int) -> ChatLogprobs:
    out = ChatLogprobs()
    for t, s, lp in zip(token_ids, token_strings(tok, token_ids), lps, strict=False):
        ranked = _ranked(lp)[:top_n]
        tops = [TopLogprob(token=ts, logprob=v, bytes=list(ts.encode()))
                for ts, (_, v) in zip(token_strings(tok, [k for k, _ in ranked]), ranked, strict=True)]
        out.content.append(TokenLogprob(token=s, logprob=lp.get(t, LOGPROB_FLOOR), bytes=list(s.encode()),
                                        top_logprobs=tops))
    return out
