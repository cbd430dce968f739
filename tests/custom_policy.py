"""A user's scheduling policy, as `--scheduling-policy tests.custom_policy:LongestPromptFirst` loads it
(tests/unit/test_policies.py)."""

from __future__ import annotations

from collections.abc import Sequence

from gpu_worker.core.policies import SchedulingPolicy
from gpu_worker.core.request import Request


class LongestPromptFirst(SchedulingPolicy):
    """Admit the longest prompt first; when blocks run out, preempt the request with the least KV computed
    (the least work lost)."""

    def next_to_admit(self, waiting: Sequence[Request], now: float) -> Request:
        return max(waiting, key=lambda r: r.num_prompt_tokens)

    def next_to_preempt(self, running: Sequence[Request], now: float) -> Request:
        return min(running, key=lambda r: r.num_computed_tokens)
