"""The stop-string check costs O(longest stop string) per new token, never O(text so far): over a long output
with long stop strings that keep almost matching, the text the detokenizer searches (the short tail it keeps
plus the text not yet taken) and the token window it decodes stay bounded, counted in characters and ids."""

from __future__ import annotations

import random

import pytest

from gpu_worker.engine.detokenizer import IncrementalDetokenizer
from shared.sampling_params import MAX_STOP, MAX_STOP_LEN

pytestmark = pytest.mark.unit

VOCAB = ["a", "b", "ab", "ba", "c", "abc", " ", "bb"]
LONGEST_PIECE = max(len(v) for v in VOCAB)


class CountingTokenizer:
    def __init__(self) -> None:
        self.widest = 0  # the most ids decoded in one call

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.widest = max(self.widest, len(ids))
        return "".join(VOCAB[i] for i in ids)


@pytest.mark.parametrize("include", [False, True])
def test_scanned_text_per_token_is_bounded_by_the_stop_length(include):
    rng = random.Random(3)
    # MAX_STOP strings of MAX_STOP_LEN characters over the same letters as the output: prefixes of them end
    # the text all the time (long hold-backs), and they never match whole ("c" breaks each one).
    stop = ["".join(rng.choice("ab") for _ in range(MAX_STOP_LEN - 1)) + "c" for _ in range(MAX_STOP)]
    tok = CountingTokenizer()
    det = IncrementalDetokenizer(tok, [0, 1], stop=stop, include_stop_str_in_output=include)
    scanned: list[int] = []
    check, hold = det._check_stop, det._hold

    def counted_check(new_from: int) -> str | None:
        scanned.append(len(det._taken_tail) + len(det._pending))  # what it joins and searches
        return check(new_from)

    def counted_hold() -> int:
        scanned.append(len(det._pending))
        return hold()

    det._check_stop, det._hold = counted_check, counted_hold
    produced = 0
    for _ in range(20_000):
        assert det.add_tokens([rng.choice([0, 1, 2, 3])]) is None
        produced += len(det.take_text(finished=False))
    assert produced > 20_000  # the output grew long ...
    assert len(scanned) >= 20_000
    # ... while each check searched at most the kept tail, the held-back text and one token's piece
    assert max(scanned) <= 2 * (MAX_STOP_LEN - 1) + LONGEST_PIECE, max(scanned)
    assert tok.widest <= 8  # the decode window: a few context tokens plus the new one, never the output
