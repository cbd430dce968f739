"""gateway.tokenizer.Tokenizers: a model's tokenizer is loaded once, whether it is asked for by the alias the
gateway preloads or by the path the workers report (a second load on the first request cost ~5 s)."""

from __future__ import annotations

import asyncio

import pytest

from gateway import tokenizer

pytestmark = pytest.mark.unit


def test_an_alias_and_its_path_share_one_load(monkeypatch):
    loads = []
    monkeypatch.setattr(tokenizer, "resolved_path", lambda name: "/models/smollm2" if name in ("smollm2", "/models/smollm2") else None)
    monkeypatch.setattr(tokenizer, "load_tokenizer", lambda model: loads.append(model) or f"tok({model})")

    async def go():
        toks = tokenizer.Tokenizers(threads=1)
        toks.preload("smollm2")  # the gateway, at start
        by_path = await toks.get("/models/smollm2")  # the first request: workers report their path
        by_alias = await toks.get("smollm2")
        other = await toks.get("unknown-model")
        toks.close()
        return by_path, by_alias, other

    by_path, by_alias, other = asyncio.run(go())
    assert by_path is by_alias and loads == ["smollm2", "unknown-model"]
    assert other == "tok(unknown-model)"


PROMPTS = ["Hello there", "", "  leading spaces", "ünïcödé 漢字 🙂", "a\nb\tc", "<|im_start|>user\nhi<|im_end|>",
           "The quick brown fox " * 40]


def test_prompt_ids_are_what_the_tokenizers_own_call_gives():
    from tests.tiny_models import default_tokenizer

    tok = default_tokenizer()
    for prompt in PROMPTS:
        assert tokenizer.prompt_ids(tok, prompt) == list(tok(prompt)["input_ids"]), prompt
    assert tokenizer._direct_encoders[tok] is not None  # the Rust tokenizer's own encode was used


def test_a_tokenizer_whose_python_side_adds_tokens_keeps_its_own_call():
    from tests.tiny_models import default_tokenizer

    real = default_tokenizer()

    class AddsABos:  # a tokenizer whose call adds what its Rust tokenizer does not
        backend_tokenizer = real.backend_tokenizer

        def __call__(self, text):
            return {"input_ids": [1] + real.backend_tokenizer.encode(text).ids}

    tok = AddsABos()
    assert tokenizer.prompt_ids(tok, "Hello there") == [1] + real.backend_tokenizer.encode("Hello there").ids
    assert tokenizer._direct_encoders[tok] is None
