"""One worker over several devices: the model runner of rank 0 under tensor parallelism.

`TensorParallelRunner.start(...)` is called in the worker process, which is rank 0. It starts N-1 executor
processes (torch.multiprocessing, spawn), and the N processes form one torch.distributed group: NCCL on CUDA
(rank r on cuda:r), gloo on CPU (each rank on its share of the worker's CPUs; there the forward's all-reduces and
the logits' gather go through shared memory, shm_comm, when they fit its buffers). Every rank builds a ModelRunner
over its shard of the weights and KV heads (tp_group). Rank 0 keeps the scheduler: before each forward it sends
the step, as one tensor of ints (`encode_step`), to the others on a gloo group, and they run the same forward;
the logits are gathered on every rank and rank 0 samples.

Faults: a rank that dies, or a forward that raises on any rank, breaks the group for good (the ranks could no
longer meet in their collectives). The runner then raises TensorParallelFault (a RunnerFault: the engine
makes it an EngineFault, blaming no request), or reports it through `fault()` while
the worker is idle: the worker stops serving and exits 1, its supervisor starts it again, and the fleet's
takeover resumes its requests. Executor processes die with rank 0 (parent-death signal, and a closed socket
ends their wait for the next step).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpu_worker.core.sched_output import ScheduledSeq, SchedulerOutput
from gpu_worker.executor.model_loader import load_model_files
from gpu_worker.executor.model_runner import ModelRunner, RunnerFault
from gpu_worker.executor.models.llama import decoder_arch
from gpu_worker.executor.prompt_logprobs import PromptLogprobs
from gpu_worker.executor.shm_comm import ShmComm
from gpu_worker.executor.tp_group import TPGroup, cpu_group, init_cpu_group, vocab_shard

log = logging.getLogger(__name__)

STOP = -1  # a step length that tells the executors to exit
FOREVER_S = 10 * 365 * 86400.0  # an idle worker's executors wait this long for the next step


class TensorParallelFault(RunnerFault):
    """The group is broken, or never formed: a rank died, or a forward failed on some rank."""


# ---- the step as ints --------------------------------------------------------------------------------------

def encode_step(sched: SchedulerOutput) -> torch.Tensor:
    """-> int64 [L]: [num seqs, num copies, (src, dst) * copies, then per seq: num tokens, start pos, num blocks,
    sample, num prompt-logprob targets, their top N, tokens..., blocks..., slots..., targets...]. Request ids
    stay on rank 0: the forward does not need them (every rank computes the same logits: they are gathered)."""
    out = [len(sched.seqs), len(sched.blocks_to_copy)]
    for src, dst in sched.blocks_to_copy:
        out += (src, dst)
    for s in sched.seqs:
        out += (len(s.token_ids), s.start_pos, len(s.block_table), int(s.sample), len(s.prompt_logprob_targets),
                s.num_prompt_logprobs)
        out += s.token_ids
        out += s.block_table
        out += s.slot_mapping
        out += s.prompt_logprob_targets
    return torch.tensor(out, dtype=torch.long)


def decode_step(data: torch.Tensor) -> SchedulerOutput:
    v = data.tolist()
    num_seqs, num_copies = v[0], v[1]
    i = 2
    copies = [(v[i + 2 * k], v[i + 2 * k + 1]) for k in range(num_copies)]
    i += 2 * num_copies
    seqs = []
    for n in range(num_seqs):
        num_tokens, start, num_blocks, sample, num_targets, top_n = v[i:i + 6]
        i += 6
        tokens, i = v[i:i + num_tokens], i + num_tokens
        blocks, i = v[i:i + num_blocks], i + num_blocks
        slots, i = v[i:i + num_tokens], i + num_tokens
        targets, i = v[i:i + num_targets], i + num_targets
        seqs.append(ScheduledSeq(f"s{n}", tokens, start, blocks, slots, bool(sample), targets, top_n))
    return SchedulerOutput(seqs=seqs, blocks_to_copy=copies)


def _send_step(length: int, data: torch.Tensor | None) -> None:
    dist.broadcast(torch.tensor([length], dtype=torch.long), src=0, group=cpu_group())
    if data is not None:
        dist.broadcast(data, src=0, group=cpu_group())


def _receive_step() -> SchedulerOutput | None:
    length = torch.empty(1, dtype=torch.long)
    dist.broadcast(length, src=0, group=cpu_group())
    if length.item() == STOP:
        return None
    data = torch.empty(int(length.item()), dtype=torch.long)
    dist.broadcast(data, src=0, group=cpu_group())
    return decode_step(data)


# ---- the processes -----------------------------------------------------------------------------------------

@dataclass
class RankSpec:
    """What every rank needs to build its runner (picklable: it crosses into the spawned processes)."""

    model: str
    size: int
    address: str  # tcp://127.0.0.1:PORT of rank 0's rendezvous
    device: str
    runner_kwargs: dict[str, Any]  # ModelRunner's keyword arguments but files, device and tp
    cpus: list[list[int]]  # per rank: the CPUs its threads run on (empty: not bound)
    threads: int  # compute threads per rank
    start_timeout_s: float
    shm: tuple[torch.Tensor, torch.Tensor] | None = None  # CPU: ShmComm's shared buffers


def _device(spec: RankSpec, rank: int) -> torch.device:
    return torch.device("cuda", rank) if spec.device.startswith("cuda") else torch.device("cpu")


def _join_group(spec: RankSpec, rank: int, abort: threading.Event | None = None) -> TPGroup:
    device = _device(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=spec.address, rank=rank, world_size=spec.size,
                            timeout=timedelta(seconds=spec.start_timeout_s))
    init_cpu_group(FOREVER_S)
    shm = ShmComm(*spec.shm, rank=rank, size=spec.size, abort=abort) if spec.shm is not None else None
    return TPGroup(rank=rank, size=spec.size, shm=shm)


def _bind(spec: RankSpec, rank: int) -> None:
    if spec.cpus and spec.cpus[rank]:
        os.sched_setaffinity(0, spec.cpus[rank])
    torch.set_num_threads(spec.threads)


def _build(spec: RankSpec, rank: int, abort: threading.Event | None = None) -> ModelRunner:
    tp = _join_group(spec, rank, abort)
    return ModelRunner(load_model_files(spec.model), device=_device(spec, rank), tp=tp, **spec.runner_kwargs)


def executor_main(rank: int, spec: RankSpec) -> None:
    """An executor process (rank >= 1): build the shard, then run every step rank 0 sends until it says stop."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: rank 0 gone (even SIGKILLed), this rank goes too
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole process group: rank 0 decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a drain is rank 0's; it sends STOP when done
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    _bind(spec, rank)
    runner = _build(spec, rank)
    while (sched := _receive_step()) is not None:
        runner.execute(sched)
        runner.take_prompt_logprobs()  # rank 0's are the answer; these only took part in the gathers
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_cpus(cpus: list[int], size: int) -> list[list[int]]:
    """The worker's CPUs in `size` equal consecutive parts (one per rank); fewer CPUs than ranks: no binding."""
    if len(cpus) < size:
        return []
    per = len(cpus) // size
    return [cpus[r * per:(r + 1) * per] for r in range(size)]


class TensorParallelRunner:
    """Rank 0's runner: the ModelRunner interface the engine uses (execute, num_blocks, vocab_size, device),
    each step sent to the executors first."""

    def __init__(self, runner: ModelRunner, procs: list[Any], abort: threading.Event):
        self.runner, self.procs, self._abort = runner, procs, abort
        self.device, self.num_blocks, self.vocab_size = runner.device, runner.num_blocks, runner.vocab_size
        self.tp = runner.tp
        self._fault: str | None = None
        self._closed = False
        self._watch = threading.Thread(target=self._watch_ranks, name="kvfleet-tp-watch", daemon=True)
        self._watch.start()
        atexit.register(self.close)

    @classmethod
    def start(cls, model: str, size: int, *, device: str = "cpu", start_timeout_s: float = 300.0,
              max_num_batched_tokens: int = 2048, **runner_kwargs: Any) -> TensorParallelRunner:
        """Start ranks 1..size-1, join them as rank 0 and build every shard. ValueError when the model does not
        split `size` ways (before any process starts); TensorParallelFault when a rank dies or the group does
        not form within start_timeout_s."""
        files = load_model_files(model)
        decoder_arch(files.config, TPGroup(rank=0, size=size))  # the divisibility checks, here and now
        if device.startswith("cuda") and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; this machine has "
                             f"{torch.cuda.device_count()}")
        cpus = sorted(os.sched_getaffinity(0))
        threads = max(torch.get_num_threads() // size, 1)
        shm = None
        if not device.startswith("cuda"):  # room for the largest all-reduce (a step's hidden states) and gather
            cfg = files.config
            _, _, shard = vocab_shard(cfg.vocab_size, 0, size)
            capacity = max(max_num_batched_tokens * cfg.hidden_size, runner_kwargs.get("max_num_seqs", 128) * shard)
            shm = ShmComm.allocate(size, capacity)
        spec = RankSpec(model=model, size=size, address=f"tcp://127.0.0.1:{_free_port()}", device=device,
                        runner_kwargs=runner_kwargs, cpus=split_cpus(cpus, size), threads=threads,
                        start_timeout_s=start_timeout_s, shm=shm)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=executor_main, args=(rank, spec), name=f"kvfleet-tp-rank{rank}", daemon=True)
                 for rank in range(1, size)]
        for p in procs:
            p.start()
        log.info("tensor parallel: %d ranks (%s), %d compute threads each%s", size,
                 "nccl" if shm is None else
                 f"gloo; all-reduces through {shm[0].numel() * 4 / 2**20:.0f} MiB of shared memory", threads,
                 f", CPUs {spec.cpus}" if spec.cpus else "")
        abort = threading.Event()
        started = time.monotonic()
        try:
            _bind(spec, 0)
            runner = _build(spec, 0, abort)
        except Exception as e:
            dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(procs, 1) if not p.is_alive()]
            for p in procs:
                p.kill()
            raise TensorParallelFault(f"the tensor-parallel group did not form ({'; '.join(dead) or e}) after "
                                      f"{time.monotonic() - started:.0f}s") from e
        return cls(runner, procs, abort)

    def paths(self) -> dict[str, str]:
        return self.runner.paths() | {"tensor parallel": f"{self.tp.size} ranks"}

    def fault(self) -> str | None:
        """Why the group is broken, or None."""
        return self._fault

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        return self.runner.take_prompt_logprobs()

    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        if self._fault:
            raise TensorParallelFault(f"tensor parallel: {self._fault}")
        try:
            data = encode_step(sched)
            _send_step(data.numel(), data)
            return self.runner.execute(sched)
        except Exception as e:  # the ranks are out of step now: no bisecting, no retry
            self._fault = self._fault or f"a forward failed: {type(e).__name__}: {e}"
            raise TensorParallelFault(f"tensor parallel: {self._fault}") from e

    def close(self) -> None:
        """Tell the executors to exit and wait for them (SIGKILL after 10 s, at once when the group is broken:
        they could wait for a step forever)."""
        if self._closed:
            return
        self._closed = True
        if not self._fault:
            try:
                _send_step(STOP, None)
            except Exception:  # noqa: BLE001 (a rank is gone: nothing to tell it)
                pass
        for p in self.procs:
            p.join(0 if self._fault else 10)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _watch_ranks(self) -> None:
        while not self._closed:
            for rank, p in enumerate(self.procs, 1):
                if not p.is_alive() and not self._closed:
                    self._fault = self._fault or f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    self._abort.set()  # a collective waiting for it in shared memory gives up
                    log.critical("tensor parallel: %s; the engine cannot go on", self._fault)
                    return
            time.sleep(0.5)
