"""When a child of `kvfleet up` that exited starts again, and when it stays down (no processes here: the
launcher spawns them; this module only decides, on a clock it is given, so tests drive it with a fake one).

A child that exits is restarted after a delay that starts at 1 s and doubles with each restart up to 30 s; a
child that ran for a healthy minute before it exited starts over at 1 s. A child that exits again after it was
restarted 5 times within 60 s is in a crash loop: it stays down (restarting it again would only hide the cause).
"""

from __future__ import annotations

import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    healthy_after_s: float = 60.0  # this long up, and the next exit restarts after first_delay_s again
    max_restarts: int = 5  # restarts within window_s; an exit past that is a crash loop
    window_s: float = 60.0


# The private Redis of `kvfleet up` keeps its data in its AOF, and every child waits on it: it starts again at
# after 0.5 s, doubling up to 2 s; an exit past 5 restarts within a minute stops the fleet (services.private_redis).
REDIS_POLICY = RestartPolicy(first_delay_s=0.5, max_delay_s=2.0)


class ChildRestarts:
    """The restart record of one child: call `started()` when it starts, `exited()` when it exits (the delay
    before it starts again, or None: crash loop, it stays down), and start it again once `due()`."""

    def __init__(self, policy: RestartPolicy = RestartPolicy(), clock: Callable[[], float] = time.monotonic):
        self.policy, self.clock = policy, clock
        self.restarts = 0  # times started again after an exit
        self.exits = 0
        self.down = False  # crash loop: it stays down
        self.restart_at: float | None = None  # when it is due to start again; None while it runs (or is down)
        self._delay = policy.first_delay_s
        self._recent: deque[float] = deque()  # when the restarts within the window happened
        self._started_at = clock()

    def started(self) -> None:
        """It started (again, when it was due)."""
        now = self.clock()
        if self.restart_at is not None:
            self.restarts += 1
            self._recent.append(now)
        self._started_at, self.restart_at = now, None

    def exited(self) -> float | None:
        """It exited: seconds until it starts again, or None when that was one exit too many (crash loop)."""
        now, p = self.clock(), self.policy
        self.exits += 1
        if now - self._started_at >= p.healthy_after_s:
            self._delay = p.first_delay_s
        while self._recent and now - self._recent[0] > p.window_s:
            self._recent.popleft()
        if len(self._recent) >= p.max_restarts:
            self.down = True
            return None
        delay, self._delay = self._delay, min(self._delay * 2, p.max_delay_s)
        self.restart_at = now + delay
        return delay

    def due(self) -> bool:
        return self.restart_at is not None and self.clock() >= self.restart_at

    def recent_restarts(self) -> int:
        """Restarts within the policy's window (what the crash-loop cutoff counts)."""
        return len(self._recent)


def exit_reason(returncode: int, stderr_tail: Sequence[str] = ()) -> str:
    """Why a process ended, for a person: `killed by SIGKILL`, or `exited with code 1` and its last stderr lines
    (a signal is its own reason; after an error exit the traceback's end is)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    reason = f"exited with code {returncode}"
    lines = [line.rstrip() for line in stderr_tail if line.strip()]
    if returncode and lines:
        reason += "; the end of its stderr:\n    " + "\n    ".join(lines)
    return reason
