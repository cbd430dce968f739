"""gateway.tokenizer.Tokenizers: a model's tokenizer is loaded once, whether it is asked for by the alias the
gateway preloads or by the path the workers report (a second load on the first request cost ~5 s)."""

from __future__ import annotations

import asyncio
import json

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


def test_a_gguf_tokenizer_is_read_once_then_loaded_from_the_cache_and_tokenizes_as_the_workers(monkeypatch,
                                                                                              tmp_path):
    """The gateway reads a GGUF's tokenizer out of it once (~9 s of CPU for the default model) into the kvfleet
    cache; later starts load that copy (about a second), and it gives the worker's ids, chat prompts and text."""
    import transformers

    from tests.tiny_models import default_tokenizer

    monkeypatch.setenv("HOME", str(tmp_path))  # a cache of its own
    first = tokenizer.load_tokenizer("smollm2")
    saved = list((tmp_path / ".cache" / "kvfleet" / "tokenizers").iterdir())
    assert [p.name.split("-")[0] for p in saved] == ["SmolLM2"] and (saved[0] / "tokenizer.json").is_file()

    def no_reading(*_a, **_kw):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_reading)
    again = tokenizer.load_tokenizer("smollm2")
    worker = default_tokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ünïcödé 🙂 hi"}]
    for tok in (first, again):
        for prompt in PROMPTS:
            ids = tokenizer.prompt_ids(tok, prompt)
            assert ids == list(worker(prompt)["input_ids"]), prompt
            assert tok.decode(ids) == worker.decode(ids)
        assert tokenizer.chat_ids(tok, chat) == tokenizer.chat_ids(worker, chat)
        assert (len(tok), tok.eos_token_id, tok.all_special_ids) == (len(worker), worker.eos_token_id,
                                                                     worker.all_special_ids)


@pytest.mark.parametrize(("named", "files", "loader"), [
    ("TokenizersBackend", ["tokenizer.json"], "fast"), ("PreTrainedTokenizerFast", ["tokenizer.json"], "fast"),
    ("LlamaTokenizer", ["tokenizer.json"], "auto"), ("TokenizersBackend", [], "auto"), (None, ["tokenizer.json"], "auto"),
])
def test_only_a_plain_fast_tokenizer_skips_autotokenizer(monkeypatch, tmp_path, named, files, loader):
    import transformers

    if named is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": named}))
    for f in files:
        (tmp_path / f).write_text("{}")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: ("auto", path))
    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", lambda path: ("fast", path))
    assert tokenizer._load_dir(tmp_path) == (loader, tmp_path)


def test_a_cache_that_cannot_be_written_costs_only_the_speed(monkeypatch, tmp_path):
    import transformers

    from tests.tiny_models import default_tokenizer

    worker = default_tokenizer()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *_a, **_kw: worker)  # "read" it

    def full(*_a, **_kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenizer.tempfile, "mkdtemp", full)
    assert tokenizer.load_tokenizer("smollm2") is worker
    assert list((tmp_path / ".cache" / "kvfleet" / "tokenizers").iterdir()) == []
