"""A dead letter stays small whatever landed in the request stream: a malformed entry's fields and the reason
are capped (the kvfleet:dead stream itself is capped by entry count), saying how much was cut."""

from __future__ import annotations

from shared.messages import DEAD_LETTER_RAW_CHARS, DEAD_LETTER_REASON_CHARS, DeadLetter, GenerationRequest


def test_a_huge_malformed_entry_is_kept_only_in_part():
    raw = '{"req": "' + "x" * 5_000_000 + '"}'
    letter = DeadLetter(reason="malformed request entry: " + "y" * 10_000, deliveries=1, worker_id="w0", raw=raw)
    assert letter.raw.startswith(raw[:DEAD_LETTER_RAW_CHARS])
    assert letter.raw.endswith(f"({len(raw) - DEAD_LETTER_RAW_CHARS} more characters not kept)")
    assert len(letter.reason) < DEAD_LETTER_REASON_CHARS + 100 and "more characters not kept" in letter.reason
    assert len(letter.model_dump_json()) < DEAD_LETTER_RAW_CHARS + DEAD_LETTER_REASON_CHARS + 500
    again = DeadLetter.model_validate_json(letter.model_dump_json())  # read back: unchanged, not cut twice
    assert again.raw == letter.raw and again.reason == letter.reason


def test_a_small_letter_is_kept_whole():
    request = GenerationRequest(request_id="r1", prompt_token_ids=[1, 2, 3], prompt="hi")
    letter = DeadLetter(request=request, reason="poison: failed 3 deliveries", deliveries=3, worker_id="w1",
                        raw='{"a": 1}')
    assert letter.request == request and letter.raw == '{"a": 1}' and letter.reason == "poison: failed 3 deliveries"
