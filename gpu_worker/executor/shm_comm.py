"""All-reduce and all-gather among the tensor-parallel ranks of one CPU machine through shared memory, as vLLM's
CPU backend does: gloo goes through sockets and costs ~2 ms per collective on the VMs this was measured on (a
TCP round trip there is 72 us), and a forward makes two per layer.

Each rank owns one slot of a shared float32 buffer (two of them, used in turn) and one counter. A collective:
copy this rank's tensor into its slot, publish the collective's number in its counter, wait until every
counter has it, then read all the slots (sum, or concatenate). Double buffering makes that safe without a
second barrier: a rank writes slot set k % 2 for collective k only after every rank published k - 1, which each
did after it had finished reading collective k - 2 from that set. Stores and loads are ordered as written on
x86 (TSO), which is where CPU tensor parallelism runs.

The wait spins, yielding the core after a while (ranks may outnumber cores), and gives up when `abort` is set
(rank 0's watcher: a rank died) or after STALL_S.
"""

from __future__ import annotations

import os
import threading
import time

import torch

STALL_S = 600.0  # no collective waits this long for a live rank: something is wrong
SPINS_BEFORE_YIELD = 200


class ShmStalled(RuntimeError):
    pass


class ShmComm:
    def __init__(self, slots: torch.Tensor, counters: torch.Tensor, rank: int, size: int,
                 abort: threading.Event | None = None):
        """slots: shared float32 [2, size, capacity]; counters: shared int64 [size] (allocate())."""
        self.slots, self.rank, self.size, self.abort = slots, rank, size, abort
        self.capacity = slots.shape[2]
        self._counters = counters.numpy()  # a view of the shared memory: one aligned 8-byte store per publish
        self._seq = int(self._counters[rank])

    @staticmethod
    def allocate(size: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared buffers for `size` ranks and tensors of up to `capacity` elements (before spawning the
        ranks, which receive them as arguments)."""
        return (torch.zeros(2, size, capacity, dtype=torch.float32).share_memory_(),
                torch.zeros(size, dtype=torch.int64).share_memory_())

    def fits(self, numel: int) -> bool:
        return numel <= self.capacity

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (summed in float32, in rank order: the same on every rank)."""
        n = x.numel()
        buf = self._exchange(x)
        x.view(-1).copy_(buf[:, :n].sum(0) if self.size > 2 else buf[0, :n] + buf[1, :n])
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[N, M] on every rank -> [N, size * M]: the ranks' tensors side by side, in rank order."""
        n = x.numel()
        buf = self._exchange(x)
        parts = [buf[r, :n].view(x.shape).to(x.dtype) for r in range(self.size)]
        return torch.cat(parts, dim=-1)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        self._seq += 1
        buf = self.slots[self._seq % 2]
        buf[self.rank, : x.numel()].copy_(x.reshape(-1))
        self._counters[self.rank] = self._seq  # publish after the copy (x86: stores stay in order)
        self._wait(self._seq)
        return buf

    def _wait(self, seq: int) -> None:
        counters, spins, started = self._counters, 0, 0.0
        while counters.min() < seq:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            if spins % 1000 == 0:
                now = time.monotonic()
                started = started or now
                if (self.abort is not None and self.abort.is_set()) or now - started > STALL_S:
                    raise ShmStalled(f"rank {self.rank}: a rank never reached collective {seq}")
