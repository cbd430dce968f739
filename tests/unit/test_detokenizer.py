"""The detokenizer's stop strings and hold-back, against the whole-text rule it replaces: after every step the
text taken so far is the whole text less the longest tail that begins a stop string, and a stop string cuts
the text at its first occurrence, though it keeps only the text not yet taken and a short tail."""

from __future__ import annotations

import random

import pytest

from gpu_worker.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit

VOCAB = ["a", "b", "ab", "ba", "c", "abc", " ", "bb"]


class CharTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids)


def whole_text_rule(steps: list[list[int]], stop: list[str], include: bool) -> tuple[list[str], str | None]:
    """The visible text after each step, computed on the whole text, and the stop string that ended it."""
    text, visible = "", []
    for ids in steps:
        text += "".join(VOCAB[i] for i in ids)
        found = min(((text.find(s), s) for s in stop if s in text), key=lambda f: f[0], default=None)  # ties: first
        if found is not None:
            i, s = found
            visible.append(text[: i + len(s)] if include else text[:i])
            return visible, s
        hold = 0 if include else max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        visible.append(text[: len(text) - hold])
    return visible, None


@pytest.mark.parametrize("include", [False, True])
def test_taken_text_equals_the_whole_text_rule(include):
    rng = random.Random(7)
    for _ in range(400):
        stop = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        steps = [[rng.randrange(len(VOCAB)) for _ in range(rng.choice([1, 1, 1, 3]))] for _ in range(30)]
        want, want_stop = whole_text_rule(steps, stop, include)
        detok = IncrementalDetokenizer(CharTokenizer(), [], stop=stop, include_stop_str_in_output=include)
        taken, got_stop = "", None
        for ids in steps:
            got_stop = detok.add_tokens(ids)
            taken += detok.take_text(finished=got_stop is not None)
            assert len(detok._taken_tail) < max(map(len, stop))  # a short tail, never the whole text
            if got_stop is not None:
                break
        assert (taken, got_stop) == (want[-1], want_stop), (stop, steps)
        if got_stop is None:
            assert taken + detok.take_text(finished=True) == "".join(VOCAB[i] for ids in steps for i in ids)


class ByteTokenizer:
    """Each id one byte of UTF-8; decode replaces incomplete bytes with U+FFFD, as byte-level BPE tokenizers do."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_an_output_ending_inside_a_character_ends_as_the_whole_decode_does():
    ids = list("ok é".encode()) + list("€".encode())[:2]  # the last character cut after 2 of its 3 bytes
    detok = IncrementalDetokenizer(ByteTokenizer(), [])
    detok.add_tokens(ids)
    running = detok.take_text(finished=False)
    assert running == "ok é", "held back while the character may still complete"
    assert running + detok.take_text(finished=True) == ByteTokenizer().decode(ids) == "ok é\ufffd"


def test_after_a_stop_string_nothing_held_back_is_released():
    ids = list(b"ab STOP") + list("€".encode())[:1]
    detok = IncrementalDetokenizer(ByteTokenizer(), [], stop=["STOP"])
    assert detok.add_tokens(ids) == "STOP"
    assert detok.take_text(finished=True) == "ab "


def test_the_backend_decode_is_taken_only_where_it_gives_what_decode_gives():
    """The tokenizers library's decode stands in for transformers' only for a fast tokenizer that does not clean
    up tokenization spaces afterwards (the clean-up would change the text)."""
    from tokenizers import Tokenizer, models

    from gpu_worker.engine.detokenizer import backend_decode

    class Fast:
        def __init__(self, clean_up: bool):
            self._tokenizer = Tokenizer(models.BPE())
            self.clean_up_tokenization_spaces = clean_up

    assert backend_decode(Fast(False)) is not None
    assert backend_decode(Fast(True)) is None
    assert backend_decode(CharTokenizer()) is None
