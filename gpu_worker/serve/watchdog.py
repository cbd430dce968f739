"""The worker's stall watchdog. A worker whose main loop stops coming round (an engine step that never returns:
a deadlock, a kernel that spins, a wait on something that never comes) still heartbeats, since its status goes
out from the writer thread so that a long step does not make it look dead. The fleet would route to it and wait
on its requests forever. Past `stall_s` without a turn of the main loop, the watchdog logs where the main thread
is stuck, has the writer flush and remove the status (the others take its requests over at once, fenced), and
ends the process with exit status 1, so that `kvfleet up` or Kubernetes starts it again. It cannot be stopped
from the stuck thread, hence os._exit. /livez says not live past the same `stall_s`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("kvfleet.worker")


class StallWatchdog:
    def __init__(self, worker_id: str, last_tick: Callable[[], float], stall_s: float,
                 on_stall: Callable[[], None], exit_process: Callable[[int], None] = os._exit):
        """last_tick(): time.monotonic() of the main loop's last turn. stall_s <= 0: off. on_stall: the worker's
        last words (flush the writer, remove the status), called before exit_process(1)."""
        self.worker_id, self.last_tick, self.stall_s = worker_id, last_tick, stall_s
        self.on_stall, self.exit_process = on_stall, exit_process
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name="kvfleet-watchdog", daemon=True)

    def start(self) -> StallWatchdog:
        if self.stall_s > 0:
            self._thread.start()
        return self

    def _watch(self) -> None:
        while True:
            stalled = time.monotonic() - self.last_tick()
            if stalled >= self.stall_s:
                break
            time.sleep(min(1.0, self.stall_s - stalled))
        frame = sys._current_frames().get(self._main)
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(the main thread is gone)\n"
        log.critical("worker %s is hung: its main loop has not come round for %.0fs (KVFLEET_ENGINE_STALL_S); it "
                     "exits so that its requests are taken over and it is started again. The main thread is at:\n%s",
                     self.worker_id, stalled, where.rstrip())
        try:
            self.on_stall()
        except Exception:  # noqa: BLE001 (exit anyway: its status expires within its TTL)
            log.exception("worker %s: could not remove its status before exiting", self.worker_id)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self.exit_process(1)
