"""Tool calls in a model's own format, read out of its text (tool_choice "auto", `--tool-call-parser NAME`), whole
or as the text streams in: what vLLM's tool parsers do, for the formats below.

- hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, text around them (Hermes, Qwen
  2.5+, SmolLM3; kvfleet's `chatml-tools` chat template teaches it to ChatML models such as SmolLM2);
- mistral: [TOOL_CALLS] then a JSON array of {"name", "arguments"} to the end of the answer (Mistral's special
  token, so the answer is detokenized with special tokens kept);
- llama3_json: the answer is a JSON object {"name", "parameters" (or "arguments")}, or several separated by ";"
  (Llama 3.1+'s JSON tool calling; its <|python_tag|> is a special token, skipped with the others).

A call whose JSON does not read as one stays text, as it came: nothing the model wrote is dropped but the markers
and the whitespace around calls. Streamed, a hermes call in its usual form ({"name": ..., "arguments": {...}}, the
name first) goes out as it comes: its name as soon as its arguments begin, then its arguments' JSON text piece by
piece, as vLLM streams them; any other call goes out whole once read. A streamed call whose JSON then breaks
stays as it went out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Piece:
    """A call as it streams: its first piece names it, the next ones add to its arguments' JSON text."""

    name: str | None
    arguments: str


@dataclass(frozen=True)
class CallFormat:
    name: str
    start: str  # opens a call (or the calls)
    end: str | None  # closes one call; None: the calls run to the end of the answer
    at_start_only: bool = False  # calls only as the whole answer (after leading whitespace)
    start_in_body: bool = False  # the start marker is the body's own first character (llama3_json's "{")
    keeps_special_tokens: bool = False  # its markers are special tokens: detokenize without skipping them
    streams_arguments: bool = False  # one call per body, whose arguments can go out as they come

    def read(self, body: str) -> list[Call] | None:
        """The calls in a body (what lies between the markers); None when it does not read as calls."""
        try:
            if self.name == "hermes":
                return _calls([json.loads(body)])
            if self.name == "mistral":
                items = json.loads(body)
                return _calls(items if isinstance(items, list) else [items])
            decoder, items, pos = json.JSONDecoder(), [], 0  # llama3_json: objects separated by ";"
            while pos < len(body):
                item, pos = decoder.raw_decode(body, pos)
                items.append(item)
                rest = body[pos:].lstrip()
                if rest and not rest.startswith(";"):
                    return None
                pos = len(body) - len(rest) + (1 if rest else 0)
                while pos < len(body) and body[pos].isspace():
                    pos += 1
            return _calls(items)
        except ValueError:
            return None


def _calls(items: list[Any]) -> list[Call] | None:
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        calls.append(Call(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


FORMATS: dict[str, CallFormat] = {f.name: f for f in (
    CallFormat("hermes", "<tool_call>", "</tool_call>", streams_arguments=True),
    CallFormat("mistral", "[TOOL_CALLS]", None, keeps_special_tokens=True),
    CallFormat("llama3_json", "{", None, at_start_only=True, start_in_body=True),
)}


# a call body in its usual form, up to where its arguments' value begins
_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:')
_NAMED_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class _ArgumentStream:
    """Follows one call body as it arrives: once its name is read and its arguments (an object) begin, the name,
    then each new piece of the arguments' text up to the object's end. `whole`: not in that form, so the call
    goes out once read."""

    def __init__(self) -> None:
        self.whole = False
        self.started = False
        self.sent = 0  # characters of the arguments sent
        self._start = 0  # where the arguments begin in the body
        self._end: int | None = None  # where they end (once seen)
        self._depth, self._in_string, self._escaped, self._scanned = 0, False, False, 0

    def pieces(self, body: str) -> list[Piece]:
        if self.whole or self._end is not None:
            return []
        out = []
        if not self.started:
            m = _NAMED_FIRST.match(body)
            if m is None or m.end() >= len(body):
                if m is None and (_ARGUMENTS_KEY.search(body) or body.lstrip()[:1] not in ("", "{")):
                    self.whole = True  # the arguments began, and not after the name
                return []
            if body[m.end()] != "{":  # arguments as a string (or not an object): read whole
                self.whole = True
                return []
            try:
                name = json.loads(m.group(1))
            except ValueError:
                self.whole = True
                return []
            self.started, self._start, self._scanned = True, m.end(), m.end()
            out.append(Piece(name, ""))
        for i in range(self._scanned, len(body)):
            c = body[i]
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (c == "\\", c != '"')
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end = i + 1
                    break
        self._scanned = self._end if self._end is not None else len(body)
        text = body[self._start + self.sent:self._scanned]
        if text:
            out.append(Piece(None, text))
            self.sent += len(text)
        return out


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (kept until the next text says)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class CallScanner:
    """One answer's text as it streams in -> the text to show now and the calls completed now. Text that could
    begin a call is held until it is known; so is whitespace, which is dropped where it only separates calls."""

    def __init__(self, fmt: CallFormat):
        self.fmt = fmt
        self.calls = 0  # calls read so far
        self._buf = ""
        self._in_call = False
        self._plain = False  # at_start_only: the answer began with text, so it holds no calls
        self._streaming: _ArgumentStream | None = None  # the call being read, when its format streams arguments
        self._gap = ""  # the whitespace before the call being read

    def feed(self, text: str) -> tuple[str, list[Call | Piece]]:
        """The text to show now, and the calls read (whole) or going out (pieces) now."""
        self._buf += text
        shown: list[str] = []
        calls: list[Call | Piece] = []
        while True:
            if self._in_call:
                j = self._buf.find(self.fmt.end) if self.fmt.end is not None else -1
                if self._streaming is not None:  # not what may begin the end marker
                    seen = self._buf[:j] if j >= 0 else self._buf[:len(self._buf) - _held_back(self._buf, self.fmt.end)]
                    calls += self._streaming.pieces(seen)
                if j < 0:
                    break
                unread, read = self._read(self._buf[:j], closed=True)
                shown.append(unread)
                calls += read
                self._buf = self._buf[j + len(self.fmt.end):]
                self._in_call = False
                continue
            if self._plain:
                shown.append(self._buf)
                self._buf = ""
                break
            i = self._buf.find(self.fmt.start)
            stripped = self._buf.lstrip()
            if self.fmt.at_start_only and stripped and not stripped.startswith(self.fmt.start[:len(stripped)]):
                self._plain = True
                continue
            if i >= 0 and (not self.fmt.at_start_only or not self._buf[:i].strip()):
                before = self._buf[:i]
                if before.strip():
                    shown.append(before.rstrip())
                self._gap = before[len(before.rstrip()):]  # shown after all if the call does not read
                self._buf = self._buf[i if self.fmt.start_in_body else i + len(self.fmt.start):]
                self._in_call = True
                self._streaming = _ArgumentStream() if self.fmt.streams_arguments else None
                continue
            keep = _held_back(self._buf, self.fmt.start)
            while keep < len(self._buf) and self._buf[-keep - 1].isspace():
                keep += 1
            out = self._buf[:len(self._buf) - keep]
            if out.strip() or (out and not self.calls):  # whitespace between calls is not text
                shown.append(out)
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(shown), calls

    def close(self) -> tuple[str, list[Call | Piece]]:
        """The answer ended: what was held."""
        rest, self._buf = self._buf, ""
        if self._in_call:  # no end marker (cut by EOS or max_tokens): a body that reads whole still counts
            self._in_call = False
            pieces: list[Call | Piece] = self._streaming.pieces(rest) if self._streaming is not None else []
            unread, read = self._read(rest, closed=False)
            return unread, pieces + read
        return (rest if rest.strip() or not self.calls else ""), []

    def _read(self, body: str, *, closed: bool) -> tuple[str, list[Call | Piece]]:
        """A call's body -> its calls, or (when it does not read as calls) the text it came as; nothing more for a
        call whose pieces went out already."""
        streamed, self._streaming = self._streaming is not None and self._streaming.started, None
        if streamed:
            self.calls += 1
            return "", []
        calls = self.fmt.read(body.strip())
        if calls is None:
            start = "" if self.fmt.start_in_body else self.fmt.start
            return self._gap + start + body + (self.fmt.end or "" if closed else ""), []
        self.calls += len(calls)
        return "", list(calls)
