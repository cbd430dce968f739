"""A failure that repeats, logged as one outage rather than once per try.

A loop that retries a Redis call every 0.1-1 s wrote a warning at every try: a worker wrote ~80 lines in a 30 s Redis
outage (its request reader, its cancel reader and its writer, each about twice a second), a gateway one a second for
its inbox and one per request it refused. A ten-minute outage buried the log. Now each loop (or door) says:
- the first failure, at once, with its error;
- while failures of the same kind go on, one line every `every_s` (30 s): for how long, how many tries, the last error;
- a failure of another kind (a lost consumer group after a refused connection, say), at once;
- the first success after failures, that it works again and after how long (`ok`).
A door that never sees a success (a gateway answering 503s) ends its outage by quiet: a failure more than `every_s`
after the last one starts a new outage, said at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

EVERY_S = 30.0


def kind_of(e: BaseException) -> str:
    """The exception's class, and for a Redis error reply its code (NOGROUP, WRONGTYPE, MISCONF...): a new kind of
    failure is said at once, whatever was said before."""
    code = str(e).split(" ", 1)[0]
    return type(e).__name__ + (f":{code}" if code.isupper() and code.isalpha() else "")


class OutageLog:
    """The log of one retried call (one loop, one thread or one asyncio task: not locked). `what` names the call,
    `"redis request read"`; the lines read "redis request read failed (...); retrying"."""

    def __init__(self, log: logging.Logger, what: str, every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.what, self.every_s, self.clock = log, what, every_s, clock
        self.since: float | None = None  # the first failure of the outage going on; None: none goes on
        self.tries = 0  # failures in this outage
        self._kind = ""
        self._said = self._last = float("-inf")

    def failed(self, e: BaseException, then: str = "retrying") -> None:
        """One more failure; logged if it is the first of an outage, of a new kind, or the first for `every_s`."""
        now, kind = self.clock(), kind_of(e)
        if self.since is None or now - self._last > self.every_s:
            self.since, self.tries, self._kind = now, 0, ""
        self.tries, self._last = self.tries + 1, now
        if kind != self._kind:
            self._kind, self._said = kind, now
            self.log.warning("%s failed (%s); %s (said again every %.0f s while it fails)", self.what, e, then,
                             self.every_s)
        elif now - self._said >= self.every_s:
            self._said = now
            self.log.warning("%s still failing after %.0f s (%d tries; the last: %s); %s", self.what,
                             now - self.since, self.tries, e, then)

    def ok(self) -> None:
        """The call went through: if an outage went on, say it is over."""
        if self.since is not None:
            self.log.info("%s works again after %.1f s (%d failed tries)", self.what, self.clock() - self.since,
                          self.tries)
            self.since, self.tries, self._kind = None, 0, ""
