"""What the engine returns per request and step (vLLM's shapes, as RequestOutputKind.DELTA): each output
carries only what is new since the request's last output: token ids, text, logprobs. A step so costs what
it produced, not the length of the outputs so far. OutputAccumulator folds the deltas into the complete
output that the offline API (gpu_worker.engine.llm) returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # new text (held-back text that could begin a stop string comes in a later output)
    token_ids: list[int]  # new token ids
    logprobs: list[dict[int, float]] | None  # one per new token: chosen + top-N; None if not asked
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running; stays once set
    stop_reason: int | str | None = None  # the stop token id or stop string; None for eos or length
    cumulative_logprob: float | None = None  # over all the sample's tokens so far
    # once per request, in the first output with tokens (of whichever sample), when asked
    # (SamplingParams.prompt_logprobs): per prompt position the prompt token's logprob + the top N there;
    # entry 0 is None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank there (1: the likeliest)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prefix-cache hit at first admission


@dataclass
class RequestOutput:
    """One request's news from one step: a CompletionOutput per sample (n of them, in index order; a sample
    with nothing new has an empty one), and finished once every sample is."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request failed (its samples' finish_reason is then "error")
    error_kind: str = "internal"  # "invalid_request": its own input was at fault (HTTP 400, not 500)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # as vLLM's: folded in by OutputAccumulator
    prompt_logprob_ranks: list[int | None] | None = None


class OutputAccumulator:
    """Folds one request's delta RequestOutputs into its complete RequestOutput. Each delta costs its own
    size; the text pieces are joined once, in `result`."""

    def __init__(self) -> None:
        self._output: RequestOutput | None = None
        self._samples: dict[int, CompletionOutput] = {}
        self._text: dict[int, list[str]] = {}

    def add(self, delta: RequestOutput) -> None:
        if self._output is None:
            self._output = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids)
        self._output.finished, self._output.metrics = delta.finished, delta.metrics
        self._output.error = delta.error or self._output.error
        for d in delta.outputs:
            c = self._samples.get(d.index)
            if c is None:
                c = self._samples[d.index] = CompletionOutput(d.index, "", [], None if d.logprobs is None else [])
                self._text[d.index] = []
            c.token_ids += d.token_ids
            if d.prompt_logprobs is not None:
                self._output.prompt_logprobs = d.prompt_logprobs
                self._output.prompt_logprob_ranks = d.prompt_logprob_ranks
            if d.logprobs is not None:
                c.logprobs += d.logprobs
            self._text[d.index].append(d.text)
            c.finish_reason, c.stop_reason, c.cumulative_logprob = d.finish_reason, d.stop_reason, d.cumulative_logprob

    def result(self) -> RequestOutput:
        """The request's complete output from the deltas added so far."""
        if self._output is None:
            raise ValueError("no output was added")
        for i, c in self._samples.items():
            c.text = "".join(self._text[i])
        self._output.outputs = [self._samples[i] for i in sorted(self._samples)]
        return self._output
