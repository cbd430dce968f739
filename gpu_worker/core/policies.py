"""Scheduling policies: which waiting request the scheduler admits next, and which running request it
preempts first when the KV cache has no free block. The customization point: `--scheduling-policy
package.module:Class` (or `LLM(scheduling_policy=...)`, which also takes a policy object).

A policy subclasses SchedulingPolicy and answers two questions; the scheduler asks them as often as it needs,
each time with the current state:

- `next_to_admit(waiting, now)`: which of `waiting` to admit next. `waiting` is in queue order: new requests
  at the back, preempted ones back at the front. The scheduler admits the chosen request if the step's token
  budget, sequence cap and free blocks allow, then asks again; when its blocks do not fit, nothing else is
  admitted this step (the head of the line waits, so a big request is not starved by small ones behind it).
- `next_to_preempt(running, now)`: which of `running` (in admission order) gives its blocks back first when
  a running request needs a block and none is free. It may be the request that needs the block. The victim
  goes back to the front of the waiting queue with num_computed_tokens 0 (recompute); it keeps its priority,
  arrival time and output tokens, so it comes back as the same request. The default (every built-in policy
  keeps it) is the lowest priority (largest value), then the latest arrival.

What a policy sees: gpu_worker.core.request.Request objects, to read and never change: `request_id`,
`priority` (per request, from the API; lower runs first under "priority"), `arrival_time` (seconds on the
scheduler's clock, as `now` is: time.monotonic), `num_prompt_tokens`, `num_tokens` (prompt + output so far),
`num_computed_tokens` (tokens whose KV is in the cache; 0 for a new or preempted request),
`num_preemptions`, `sampling_params`. What it decides: the order only. The token budget, the sequence cap,
chunked prefill, block allocation and prefix caching stay with the scheduler.

The built-ins: "fcfs" (queue order), "priority" (lower value first, then earlier arrival) and "sjf"
(fewest tokens first, with aging). A user's class is built with no arguments; pass an object to build one
with arguments. Torch-free like the rest of gpu_worker.core; a user's module is imported when a config
names it, never when this module is imported.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence

from gpu_worker.core.request import Request


class SchedulingPolicy(abc.ABC):
    """The interface: subclass it, define next_to_admit, and next_to_preempt if the default does not suit."""

    @abc.abstractmethod
    def next_to_admit(self, waiting: Sequence[Request], now: float) -> Request:
        """One of `waiting` (never empty): the request to admit next."""

    def next_to_preempt(self, running: Sequence[Request], now: float) -> Request:
        """One of `running` (never empty): the request to preempt first. Default: the lowest priority
        (largest value), then the latest arrival, then the latest admitted."""
        return max(enumerate(running), key=lambda ir: (ir[1].priority, ir[1].arrival_time, ir[0]))[1]


class FCFS(SchedulingPolicy):
    """First come, first served: queue order (a preempted request is back at the front)."""

    def next_to_admit(self, waiting: Sequence[Request], now: float) -> Request:
        return waiting[0]


class Priority(SchedulingPolicy):
    """Lower `priority` value first; equal priorities by arrival."""

    def next_to_admit(self, waiting: Sequence[Request], now: float) -> Request:
        return min(waiting, key=lambda r: (r.priority, r.arrival_time))


class ShortestJobFirst(SchedulingPolicy):
    """Fewest tokens to compute first (prompt + output so far), with aging: a waiting request counts
    `block_size` tokens shorter for every `aging_s` seconds it has waited (aging_s <= 0: no aging)."""

    def __init__(self, block_size: int, aging_s: float) -> None:
        self.credit_per_s = block_size / aging_s if aging_s > 0 else 0.0

    def next_to_admit(self, waiting: Sequence[Request], now: float) -> Request:
        credit = self.credit_per_s
        return min(waiting, key=lambda r: (r.num_tokens - (now - r.arrival_time) * credit, r.arrival_time))


BUILT_IN: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFS, "priority": Priority, "sjf": ShortestJobFirst}


def policy_class(spec: str) -> type[SchedulingPolicy]:
    """A built-in name or "package.module:Class" -> the class, importing the user's module. Raises
    ValueError saying what is wrong with `spec`."""
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{spec!r} is neither a built-in policy ({', '.join(BUILT_IN)}) nor package.module:Class")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise  # the user's module was found, and it imports something that is missing
        raise ValueError(f"{spec!r}: no module named {module_name!r} (it must be importable: installed, or its "
                         f"directory on PYTHONPATH)") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, SchedulingPolicy)):
        raise ValueError(f"{spec!r}: {module_name}.{attr} is not a policy: it must be a subclass of "
                         f"gpu_worker.core.policies.SchedulingPolicy")
    return cls


def make_policy(spec: str | SchedulingPolicy, *, block_size: int, sjf_aging_s: float) -> SchedulingPolicy:
    """The policy object a scheduler uses: `spec` itself, a built-in, or the user's class built with no
    arguments."""
    if isinstance(spec, SchedulingPolicy):
        return spec
    cls = policy_class(spec)
    return ShortestJobFirst(block_size, sjf_aging_s) if cls is ShortestJobFirst else cls()
