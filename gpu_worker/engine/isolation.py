"""Fault isolation inside one engine step: a failure is pinned on the request(s) that cause it, and the rest
of the batch carries on with the results an undisturbed step gives it.

- The forward (`execute`): the whole batch first (the fast path costs one try block). If it raises, the batch
  is bisected: the older half runs first, without the newest admissions, then the newer half, each half
  split again while it fails, until every failing sequence has failed alone (about k·log2(n) extra forwards
  for k culprits in n sequences). A good sequence runs successfully exactly once, so its KV cache is
  written once and its logits are those of a normal step. When nothing succeeds in a batch of two or more
  requests, the fault is the worker's (device, model), not a request's: EngineFault, and no request is
  blamed.
- The sampler (`sample`): the whole batch first; if it raises, row by row. The sampler raises before it
  touches the logits or a generator when a row's parameters cannot be used, so greedy and seeded rows get
  the same tokens row by row as in one batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gpu_worker.core.sched_output import ScheduledSeq, SchedulerOutput
from gpu_worker.engine.sampler import Sampler, SamplerOutput, SamplingRow
from gpu_worker.executor.model_runner import RunnerFault

log = logging.getLogger(__name__)


class EngineFault(RuntimeError):
    """A step failed for every request in it, each alone too: the worker is broken, not a request."""


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def execute(run: Callable[[SchedulerOutput], torch.Tensor], sched: SchedulerOutput
            ) -> tuple[torch.Tensor | None, dict[str, str]]:
    """-> (logits [sampling seqs that ran, in batch order, V], {request id: error} of the culprits).
    Logits are None when no sampling sequence ran."""
    try:
        return run(sched), {}
    except RunnerFault as e:  # the runner is broken (a tensor-parallel rank died): no request is to blame
        raise EngineFault(str(e)) from e
    except Exception as e:  # noqa: BLE001 (any failure: find whom it belongs to)
        if len(sched.seqs) < 2:
            if not sched.seqs:
                raise EngineFault(f"the block copies before the forward failed: {describe(e)}") from e
            log.warning("forward failed for %s alone: %s", sched.seqs[0].request_id, describe(e))
            return None, {sched.seqs[0].request_id: describe(e)}
        log.warning("forward over %d sequences failed (%s): bisecting to find the culprit", len(sched.seqs),
                    describe(e))
        first_error = e
    good: dict[int, torch.Tensor | None] = {}  # index in sched.seqs -> its logits row (None: not sampling)
    culprits: dict[str, str] = {}
    _bisect(run, sched, list(range(len(sched.seqs))), good, culprits)
    if not good:
        raise EngineFault(f"every request of the step failed, each alone too: {describe(first_error)}") \
            from first_error
    for rid, err in culprits.items():
        log.error("request %s fails the forward alone: %s", rid, err)
    rows = [row for _, row in sorted(good.items()) if row is not None]
    return (torch.stack(rows) if rows else None), culprits


def _bisect(run: Callable[[SchedulerOutput], torch.Tensor], sched: SchedulerOutput, part: list[int],
            good: dict[int, torch.Tensor | None], culprits: dict[str, str]) -> None:
    """Run the sequences at `part` (indices into sched.seqs, known to fail together): older half, then newer."""
    for half in (part[: len(part) // 2], part[len(part) // 2:]):
        seqs = [sched.seqs[i] for i in half]
        try:
            logits = run(_subset(sched, seqs))
        except Exception as e:  # noqa: BLE001
            if len(half) == 1:
                culprits[seqs[0].request_id] = describe(e)
            else:
                _bisect(run, sched, half, good, culprits)
            continue
        sampling = [i for i in half if sched.seqs[i].sample]
        good.update({i: None for i in half})
        good.update({i: logits[row] for row, i in enumerate(sampling)})


def _subset(sched: SchedulerOutput, seqs: list[ScheduledSeq]) -> SchedulerOutput:
    """The step restricted to `seqs`, with the block copies into their blocks (copying again is harmless:
    a copy's source is a shared block no one writes, its destination is written only by its owner, after)."""
    blocks = {b for s in seqs for b in s.block_table}
    return SchedulerOutput(seqs=seqs, blocks_to_copy=[c for c in sched.blocks_to_copy if c[1] in blocks])


def sample(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]
           ) -> tuple[SamplerOutput, dict[int, str]]:
    """-> (the output, {row: error} of the rows that failed alone; their token is -1 and logprobs None)."""
    try:
        return sampler(logits, rows), {}
    except Exception as e:  # noqa: BLE001
        log.warning("sampling %d rows failed (%s): sampling them one by one", len(rows), describe(e))
    out = SamplerOutput(token_ids=[-1] * len(rows), logprobs=[None] * len(rows))
    failed: dict[int, str] = {}
    for i, row in enumerate(rows):
        try:
            one = sampler(logits[i:i + 1], [row])
        except Exception as e:  # noqa: BLE001
            failed[i] = describe(e)
            continue
        out.token_ids[i], out.logprobs[i] = one.token_ids[0], one.logprobs[0]
    return out, failed
