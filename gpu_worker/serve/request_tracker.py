"""What a worker knows about each request it holds: where it came from (stream entry to ack) and what it
has already sent. The engine's outputs are deltas already; the tracker numbers them into chunks.

A request taken over from a dead worker starts from the chunks that worker wrote (`Job.resume_from`): the
tokens already sent seed the engine (resume_output_token_ids), which sends none of them again, and the
chunk numbers continue, so the reader sees no token twice and none skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpu_worker.engine.outputs import RequestOutput
from shared import streams
from shared.blocks import request_blocks
from shared.messages import ChunkError, GenerationRequest, OutputChunk, Usage


@dataclass
class Job:
    """One request as a worker took it: the stream entry it must ack and the output already sent."""

    request: GenerationRequest
    stream: str
    entry_id: str
    deliveries: int = 1
    sent_tokens: list[list[int]] = field(default_factory=list)  # per choice index
    finished: list[bool] = field(default_factory=list)  # per choice index
    next_seq: int = 0
    done: bool = False  # the output stream already holds the final chunk: only the ack is missing
    need_blocks: int | None = None  # KV blocks it takes at most (as the router counts them)

    def resume_from(self, chunks: list[OutputChunk]) -> Job:
        n = max(self.request.params().n, 1 + max((c.index for c in chunks), default=0))
        self.sent_tokens = [[] for _ in range(n)]
        self.finished = [False] * n
        for c in sorted(chunks, key=lambda c: c.seq):
            if c.seq < self.next_seq:
                continue  # a duplicate written by two workers
            self.next_seq = c.seq + 1
            self.sent_tokens[c.index] += c.token_ids
            self.finished[c.index] |= c.finish_reason is not None
            self.done |= c.final
        return self

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def ack(self) -> streams.Ack:
        """Its stream entry, and the owner token every write for it is checked against."""
        return streams.Ack(self.stream, self.entry_id, self.deliveries)

    @property
    def resumed(self) -> bool:
        return any(self.sent_tokens)

    def resume_token_ids(self) -> list[list[int]] | None:
        return [list(t) for t in self.sent_tokens] if self.resumed else None


class RequestTracker:
    """Per-request send state of one worker. Owned by the worker's main thread."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.jobs: dict[str, Job] = {}
        self.started: set[str] = set()  # requests with output from this worker's engine

    def add(self, job: Job) -> None:
        try:
            n = job.request.params().n
        except (TypeError, ValueError):  # invalid parameters: it gets only its final (error) chunk
            n = 1
        if not job.sent_tokens:
            job.sent_tokens, job.finished = [[] for _ in range(n)], [False] * n
        self.jobs[job.request_id] = job

    def pop(self, request_id: str) -> Job | None:
        self.started.discard(request_id)
        return self.jobs.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.jobs

    def __len__(self) -> int:
        return len(self.jobs)

    def promised_blocks(self, block_size: int, output_cap: int) -> int:
        """Blocks the requests held here will still claim: what the router counts for each (prompt plus
        max_tokens up to `output_cap`) less what its tokens so far already hold."""
        total = 0
        for rid, job in self.jobs.items():
            if job.need_blocks is None:
                params = job.request.params()
                job.need_blocks = request_blocks(len(job.request.prompt_token_ids),
                                                 min(params.max_tokens or 1, output_cap), params.n, block_size)
            held = 0
            if rid in self.started:
                held = request_blocks(len(job.request.prompt_token_ids), max(map(len, job.sent_tokens)),
                                      len(job.sent_tokens), block_size)
            total += max(0, job.need_blocks - held)
        return total

    def chunk(self, job: Job, **kw: Any) -> OutputChunk:
        c = OutputChunk(request_id=job.request_id, seq=job.next_seq, worker_id=self.worker_id,
                        attempt=job.request.attempt, delivery=job.deliveries, **kw)
        job.next_seq += 1
        return c

    def chunks_for(self, output: RequestOutput) -> list[OutputChunk]:
        """Numbered chunks for one delta RequestOutput (gpu_worker.engine.outputs): one per choice with news;
        the last one is final when the request finished (with the error when the engine failed it)."""
        job = self.jobs[output.request_id]
        self.started.add(job.request_id)
        chunks = []
        for comp in output.outputs:
            i = comp.index
            if i >= len(job.finished) or job.finished[i]:
                continue  # its finish was sent (here, or before a takeover): the reader has all of it
            finish = comp.finish_reason
            if not comp.token_ids and not comp.text and finish is None:
                continue
            job.sent_tokens[i] += comp.token_ids
            job.finished[i] = finish is not None
            chunks.append(self.chunk(job, index=i, token_ids=comp.token_ids, text=comp.text, logprobs=comp.logprobs,
                                     finish_reason=finish, stop_reason=comp.stop_reason,
                                     prompt_logprobs=comp.prompt_logprobs,
                                     prompt_logprob_ranks=comp.prompt_logprob_ranks))
        if output.finished:
            usage = self.usage(job, output)
            error = None if output.error is None else ChunkError(kind=output.error_kind, message=output.error)
            if chunks:
                chunks[-1].final, chunks[-1].usage, chunks[-1].error = True, usage, error
            else:
                chunks.append(self.chunk(job, final=True, usage=usage, error=error))
        return chunks

    def usage(self, job: Job, output: RequestOutput) -> Usage:
        prompt = len(job.request.prompt_token_ids)
        completion = sum(len(t) for t in job.sent_tokens)
        cached = output.metrics.num_cached_tokens if output.metrics is not None else 0
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     cached_tokens=cached)

    def final_chunk(self, job: Job, *, finish_reason: str | None = None, error: ChunkError | None = None
                    ) -> OutputChunk:
        """The closing chunk of a request that ends outside the engine (cancelled, rejected, dead letter); with
        an error its finish_reason is "error"."""
        finish_reason = finish_reason or ("error" if error is not None else None)
        prompt = len(job.request.prompt_token_ids)
        completion = sum(len(t) for t in job.sent_tokens)
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        return self.chunk(job, final=True, finish_reason=finish_reason, error=error, usage=usage)
