"""Pre-faulting the KV cache: its pages made resident in the background, block by block in the order the
block pool hands blocks out, so that no forward pays a page fault when a request first writes a block.

The cache is allocated uninitialised (zeroing GiBs before the worker is ready would cost seconds of start-up).
Its first write then faults each page in, inside a forward: on a 2-core Zen 4 VM, storing a 2,048-token
prefill chunk's keys and values (30 layers) took 750-1,000 ms into fresh blocks against 24-35 ms into resident
ones. vLLM zeroes its cache while it starts; kvfleet becomes ready first and does this afterwards, on one
thread at the lowest priority (nice 19), with madvise(MADV_POPULATE_WRITE): the kernel maps the pages and
never changes their contents, so it is safe while the engine writes the same blocks. Where the kernel lacks
it (Linux < 5.14), or while the machine's available memory is low (memory_low), it stops, and the pages left
fault in on first use as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time

import torch

log = logging.getLogger("kvfleet.runner")

MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14+
CHUNK_BLOCKS = 64  # blocks per madvise call: small enough to stop promptly
# It stops (the rest faulting in when used, as without it) while the machine's available memory is below this
# share of its total or 1 GiB: several workers on one machine each size their cache from the memory free at
# their start, and a lazily faulted cache never touches the blocks its load never needs.
MIN_AVAILABLE_SHARE, MIN_AVAILABLE_BYTES = 0.10, 2**30
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def memory_low(meminfo: str | None = None) -> bool:
    """Is the machine's available memory (MemAvailable) under MIN_AVAILABLE_SHARE of MemTotal or
    MIN_AVAILABLE_BYTES? `meminfo`: the text of /proc/meminfo (read when None); False where it cannot tell."""
    try:
        if meminfo is None:
            with open("/proc/meminfo") as f:
                meminfo = f.read()
        info = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in meminfo.splitlines())
                if k in ("MemTotal", "MemAvailable")}
    except (OSError, ValueError, IndexError):
        return False
    if len(info) < 2:
        return False
    return info["MemAvailable"] < max(MIN_AVAILABLE_BYTES, MIN_AVAILABLE_SHARE * info["MemTotal"])


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


class KVPrefault:
    """Starts at once; `wait()` blocks until every block is resident (or the kernel cannot do it);
    `stop()` ends it early (the runner's shutdown)."""

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int):
        self.tensors = [t for pair in caches for t in pair]
        self.num_blocks, self.blocks_done = num_blocks, 0
        self.seconds: float | None = None
        self.supported = True
        self._stop = threading.Event()
        self._done = threading.Event()
        madvise = _madvise() if self.tensors and self.tensors[0].device.type == "cpu" else None
        if madvise is None:
            self.supported = False
            self._done.set()
            return
        self._thread = threading.Thread(target=self._run, args=(madvise,), name="kvfleet-kv-prefault", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def stop(self) -> None:
        self._stop.set()

    def _run(self, madvise) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        start = time.perf_counter()
        try:
            for first in range(0, self.num_blocks, CHUNK_BLOCKS):
                if self._stop.is_set():
                    return
                if memory_low():
                    log.warning("KV cache: pre-faulting stopped at block %d of %d: the machine's available memory "
                                "is low; the rest faults in when first used", first, self.num_blocks)
                    return
                count = min(CHUNK_BLOCKS, self.num_blocks - first)
                for t in self.tensors:
                    per_block = t.stride(0) * t.element_size()
                    lo = (t.data_ptr() + first * per_block) & ~(_PAGE - 1)
                    hi = (t.data_ptr() + (first + count) * per_block + _PAGE - 1) & ~(_PAGE - 1)
                    if madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                        err = ctypes.get_errno()
                        if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # the kernel cannot: first use does it
                            self.supported = False
                            log.info("KV cache: pages fault in on first use (madvise POPULATE_WRITE: %s)",
                                     os.strerror(err))
                            return
                        if err == errno.ENOMEM:  # out of memory: stop here, the rest faults in when used
                            log.warning("KV cache: pre-faulting stopped at block %d of %d (out of memory); the "
                                        "rest faults in when first used", first, self.num_blocks)
                            return
                self.blocks_done = first + count
            self.seconds = time.perf_counter() - start
            size = sum(t.numel() * t.element_size() for t in self.tensors)
            log.info("KV cache resident: %d blocks (%.2f GiB) pre-faulted in %.1f s in the background",
                     self.num_blocks, size / 2**30, self.seconds)
        finally:
            self._done.set()
