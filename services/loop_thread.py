"""A private asyncio event loop on a daemon thread, so sync callers (Celery tasks, FleetClient) can run the
fleet's async code. Fork-safe: a child process (Celery's prefork pool) starts its own loop on first use."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    def __init__(self, name: str = "kvfleet-loop"):
        self.name = name
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():  # forked: the parent's loop thread does not exist here
            self._pid, self._lock, self._loop, self._thread = os.getpid(), threading.Lock(), None, None
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name=self.name, daemon=True)
                self._thread.start()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run `coro` on the loop and wait for it; TimeoutError (and the coroutine cancelled) after `timeout`."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop())
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no result within {timeout:g}s") from None

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or self._pid != os.getpid():
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(5)
        loop.close()
        self._loop = self._thread = None
