"""Incremental detokenization and stop strings, one IncrementalDetokenizer per sequence.

Text grows by decoding a short window of ids: the tokens between prefix_offset and read_offset decode to
the text already emitted, those up to the end to that text plus the new piece (vLLM / TGI's offsets). A
piece that ends in an incomplete UTF-8 character ("\\ufffd") waits for the next token.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the first output tokens (leading-space handling)


@dataclass
class StopMatch:
    stop: str  # the stop string found
    truncated: bool  # text was cut back to it


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])  # context + output ids
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self._max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> StopMatch | None:
        """Append tokens; return the stop string match when the text now contains one (text is then cut)."""
        start = len(self.text)
        for tid in new_token_ids:
            self.token_ids.append(tid)
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            full_text = self._decode(self.token_ids[self.prefix_offset:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                self.text += full_text[len(prefix_text):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._check_stop(start) if self.stop and len(self.text) > start else None

    def _check_stop(self, new_from: int) -> StopMatch | None:
        """Search only where a stop string could newly end: from max_stop_len - 1 before the new text."""
        search_from = max(new_from - self._max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return StopMatch(stop=s, truncated=True)

    def visible_text(self, finished: bool) -> str:
        """The text safe to stream: while running, hold back a tail that could still begin a stop string."""
        if finished or not self.stop or self.include_stop:
            return self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self.text[: len(self.text) - hold] if hold else self.text
