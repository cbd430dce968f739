"""Spawned by test_tensor_parallel: one rank of a ShmComm exchange (a module of its own: spawn imports it)."""

import torch

from gpu_worker.executor.shm_comm import ShmComm


def rank_main(rank: int, size: int, slots, counters, rounds: int, results) -> None:
    comm = ShmComm(slots, counters, rank, size)
    torch.manual_seed(0)
    for k in range(rounds):  # every rank draws every rank's tensor, so each knows the expected sum
        n = 1 + (k * 37) % comm.capacity
        all_x = [torch.randn(n) for _ in range(size)]
        x = all_x[rank].clone()
        comm.all_reduce(x)
        if not torch.equal(x, torch.stack(all_x).sum(0) if size > 2 else all_x[0] + all_x[1]):
            results.put((rank, k, "all_reduce"))
            return
        g = comm.all_gather(all_x[rank].view(1, n))
        if not torch.equal(g, torch.cat(all_x).view(1, size * n)):
            results.put((rank, k, "all_gather"))
            return
    results.put((rank, rounds, "ok"))
