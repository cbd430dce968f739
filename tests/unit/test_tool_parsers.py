"""The models' own tool-call formats (gateway.tool_parsers): each read whole, and streamed in pieces of any size
with the same result; text that is not a call passes through as it came."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tool_parsers import FORMATS, Call, CallScanner, Piece

pytestmark = pytest.mark.unit


def scan(fmt: str, text: str, cuts: list[int] | None = None) -> tuple[str, list[tuple[str, dict]]]:
    """The text shown and the calls read (a streamed call's pieces put together), feeding `text` cut at `cuts`
    (None: whole)."""
    scanner, shown, events = CallScanner(FORMATS[fmt]), [], []
    bounds = [0, *sorted(set(cuts or [])), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        out, read = scanner.feed(text[a:b])
        shown.append(out)
        events += read
    out, read = scanner.close()
    calls: list[list[str]] = []
    for e in events + read:
        if isinstance(e, Call):
            calls.append([e.name, e.arguments])
        elif e.name is not None:  # a streamed call begins
            calls.append([e.name, e.arguments])
        else:
            calls[-1][1] += e.arguments
    return "".join(shown) + out, [(name, _json_or_text(args)) for name, args in calls]


def _json_or_text(args: str):
    """A call's arguments as JSON; a streamed call whose JSON broke after it went out stays its text."""
    try:
        return json.loads(args)
    except ValueError:
        return args


def test_a_hermes_call_streams_its_name_then_its_arguments_as_they_come():
    scanner = CallScanner(FORMATS["hermes"])
    assert scanner.feed('Sure. <tool_call>\n{"name": "get_weather", "argu') == ("Sure.", [])
    assert scanner.feed('ments": {"city": "Pa') == ("", [Piece("get_weather", ""), Piece(None, '{"city": "Pa')])
    assert scanner.feed('ris"}}\n</tool') == ("", [Piece(None, 'ris"}')])
    assert scanner.feed("_call>") == ("", []) and scanner.close() == ("", [])
    other = CallScanner(FORMATS["hermes"])  # the arguments before the name: the call goes out whole, once read
    assert other.feed('<tool_call>{"arguments": {"x": 1}, "name": "f"}') == ("", [])
    assert other.feed("</tool_call>") == ("", [Call("f", '{"x": 1}')])


CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n',
     "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>', "", [("f", {"a": [1, 2]})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1})]),  # no close: EOS
    ("hermes", '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),  # cut: text
    ("hermes", '<tool_call>{"name": 3}</tool_call> and on', '<tool_call>{"name": 3}</tool_call> and on', []),
    ("hermes", "a < b and <tool but no call  \n", "a < b and <tool but no call  \n", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"s": "}{\\"", "n": [1, {"m": 2}]}}</tool_call>', "",
     [("f", {"s": '}{"', "n": [1, {"m": 2}]})]),  # braces and quotes inside strings do not end the arguments
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}, oops</tool_call>', "", [("f", {"a": 1})]),  # streamed
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', "Sure",
     [("f", {"a": 1}), ("g", {})]),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("llama3_json", ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", 'Answer: {"name": "f", "parameters": {}}', 'Answer: {"name": "f", "parameters": {}}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call stays text
    ("llama3_json", ' \n{"answer": 42}', ' \n{"answer": 42}', []),  # with the whitespace before it
    ("hermes", 'So:\n<tool_call>oops</tool_call>', 'So:\n<tool_call>oops</tool_call>', []),
]


@pytest.mark.parametrize(("fmt", "text", "shown", "calls"), CASES)
def test_each_format_read_whole_and_in_every_two_pieces(fmt, text, shown, calls):
    assert scan(fmt, text) == (shown, calls)
    for cut in range(1, len(text)):
        assert scan(fmt, text, [cut]) == (shown, calls), cut


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(min_value=1, max_value=200), max_size=12))
def test_any_cutting_of_the_stream_reads_the_same(case, cuts):
    fmt, text, shown, calls = case
    assert scan(fmt, text, [c for c in cuts if c < len(text)]) == (shown, calls)


# characters and the pieces of calls, in any order: markers, halves of them, a call's beginning, JSON bits
PIECES = [*"ab <>/{}[]\n\"\\:;,", "<tool_call>", "</tool_call>", "</tool", "_call>", "[TOOL_CALLS]",
          '{"name": "f", "arguments": {', '{"name": "g", "parameters": {}}', '"x": 1', "}"]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(sorted(FORMATS)), st.lists(st.sampled_from(PIECES), max_size=16).map("".join),
       st.lists(st.integers(min_value=1, max_value=120), max_size=8))
def test_any_text_reads_the_same_however_it_is_cut_and_without_calls_comes_out_as_it_went_in(fmt, text, cuts):
    shown, calls = scan(fmt, text, [c for c in cuts if c < len(text)])
    if not calls:
        assert shown == text
    assert (shown, calls) == scan(fmt, text)
