"""The model runner: owns the model and the paged KV cache; turns a SchedulerOutput into one forward.

execute(sched_out) applies copy-on-write block copies, runs every scheduled token in one forward and
returns float32 logits only for the sequences that sample this step (lm_head runs on those rows only). A
sequence that asks for its prompt's logprobs also has its chunk's rows scored (prompt_logprobs): the engine
takes those with take_prompt_logprobs() after the step.
On CPU with N > 1 torch threads, the step's sequences are split into N groups (batch_split) that run as N
concurrent forwards, one thread each, with single-threaded ops (see batch_split for why), except for steps
of few tokens when the matmuls split their columns across threads (LinearPlan.splits_columns):
those run as one forward on all threads.

Under tensor parallelism (`tp`) every rank owns one of these over its shard of the model and of the KV heads;
rank 0's is driven by tp_runner, which sends each step to the others first. Each rank then runs one forward
per step (its collectives must come in the same order on every rank), and the block count is the smallest
any rank can hold, so the block tables mean the same everywhere.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain

import torch

from gpu_worker.core.config import num_blocks_for_memory, parse_memory_size
from gpu_worker.core.sched_output import ScheduledSeq, SchedulerOutput
from gpu_worker.executor.batch_split import split_batch
from gpu_worker.executor.host_malloc import keep_freed_memory, release_freed
from gpu_worker.executor.kv_prefault import KVPrefault
from gpu_worker.executor.model_loader import ModelFiles
from gpu_worker.executor.models.llama import LlamaForCausalLM
from gpu_worker.executor.ops import AttentionMetadata
from gpu_worker.executor.ops.cpu import kernels as cpu_kernels
from gpu_worker.executor.ops.cpu import linear as cpu_linear
from gpu_worker.executor.prompt_logprobs import PromptLogprobs, score_rows
from gpu_worker.executor.tp_group import TPGroup

log = logging.getLogger(__name__)

CPU_KV_CACHE_MAX_BYTES = 4 * 2**30  # like vLLM CPU's default KV cache space
CPU_MEMORY_FRACTION = 0.5  # of MemAvailable, when sizing from free memory
CUDA_MEMORY_FRACTION = 0.85  # of free device memory after the weights are loaded


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV cache: device memory on CUDA, MemAvailable from /proc/meminfo on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * CUDA_MEMORY_FRACTION)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                kib = int(line.split()[1])
                return min(int(kib * 1024 * CPU_MEMORY_FRACTION), CPU_KV_CACHE_MAX_BYTES)
    return CPU_KV_CACHE_MAX_BYTES  # pragma: no cover - every Linux has MemAvailable


class RunnerFault(RuntimeError):
    """The runner can run no step any more (a tensor-parallel rank died, or its ranks fell out of step): the
    fault is the worker's, not a request's."""


@dataclass
class KVCacheShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def choose_num_blocks(shape: KVCacheShape, device: torch.device, *, num_kv_blocks: int | None,
                      kv_cache_memory: str | int | None, max_num_seqs: int, max_model_len: int,
                      ranks: int = 1) -> int:
    """An explicit block count wins; else a memory budget; else free memory (capped at what max_num_seqs
    full-length sequences can use). `ranks` tensor-parallel ranks share a memory budget, and the free memory
    of a CPU machine (a GPU's is its rank's own): each rank's `shape` holds 1/ranks of the KV heads, so the
    same budget gives the same blocks as one process."""
    if num_kv_blocks is not None:
        if num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
        return num_kv_blocks
    budget = parse_memory_size(kv_cache_memory) if kv_cache_memory is not None else available_memory(device)
    if kv_cache_memory is not None or device.type == "cpu":
        budget //= ranks
    blocks = num_blocks_for_memory(budget, block_size=shape.block_size, num_layers=shape.num_layers,
                                   num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                                   dtype_bytes=shape.dtype.itemsize)
    if kv_cache_memory is None:
        blocks = min(blocks, max_num_seqs * -(-max_model_len // shape.block_size))
    if blocks < 1:
        raise ValueError(f"KV cache memory {budget} bytes holds no block of {shape.bytes_per_block} bytes")
    return blocks


class ModelRunner:
    def __init__(self, files: ModelFiles, *, dtype: torch.dtype, device: torch.device, max_model_len: int,
                 block_size: int, num_kv_blocks: int | None = None, kv_cache_memory: str | int | None = None,
                 max_num_seqs: int = 128, use_triton: bool | None = None, tp: TPGroup | None = None,
                 prefault_kv: bool = True):
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.tp = tp or TPGroup(rank=0, size=1)
        # CPU: a step's activations come from malloc; what one step frees stays for the next (host_malloc)
        self.allocator = keep_freed_memory() if device.type == "cpu" else None
        self.model = LlamaForCausalLM(files.config, max_positions=max_model_len, dtype=dtype, device=device,
                                      use_triton=use_triton, tp=self.tp)
        self.model.load_weights(files.weights())
        self.model.eval()
        # CPU: which matmul path for how many rows, measured on one layer's weights; the weights are packed
        # for it. None on CUDA (F.linear everywhere).
        first = self.model.layers[0]
        self.linear_plan = cpu_linear.calibrate(first.gate_up_weight, [first.qkv_weight, first.o_weight,
                                                                       first.gate_up_weight, first.down_weight])
        self.model.pack_weights(self.linear_plan)
        if self.allocator is not None:
            release_freed()  # the loaded weights that no path reads any more
        arch = self.model.arch
        shape = KVCacheShape(arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, dtype)
        self.num_blocks = choose_num_blocks(shape, device, num_kv_blocks=num_kv_blocks,
                                            kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                                            max_model_len=max_model_len, ranks=self.tp.size)
        self.num_blocks = self.tp.min_int(self.num_blocks)
        log.info("KV cache%s: %d blocks of %d tokens (%.1f MiB, %d tokens)",
                 f" of rank {self.tp.rank}/{self.tp.size}" if self.tp.size > 1 else "", self.num_blocks, block_size,
                 self.num_blocks * shape.bytes_per_block / 2**20, self.num_blocks * block_size)
        cache_shape = (self.num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # kv_caches[layer] = (key_cache, value_cache): [num_blocks, block_size, Hkv, D] each, as every op indexes
        # them; on CPU head-major in memory (cpu_kernels.head_major_kv_cache: decode attention reads each head's
        # rows of a block as one run). Left uninitialised (zeroing GiBs takes seconds); a block is zeroed when a
        # block table first names it, so never-written slots hold no NaN (masked attention weights still multiply
        # them by 0).

        def cache() -> torch.Tensor:
            if device.type == "cpu":
                return cpu_kernels.head_major_kv_cache(*cache_shape, dtype=dtype)
            return torch.empty(cache_shape, dtype=dtype, device=device)
        self.kv_caches = [(cache(), cache()) for _ in range(arch.num_layers)]
        # CPU: the pages made resident in the background, so that no forward pays their first-touch faults
        self.kv_prefault = KVPrefault(self.kv_caches if prefault_kv else [], self.num_blocks)
        self._zeroed = torch.zeros(self.num_blocks, dtype=torch.bool)  # [num_blocks]
        reads_only_written = getattr(self.model.ops.paged_attention, "reads_only_written_slots", None)
        self._zero_fresh_blocks = not (reads_only_written and reads_only_written(dtype))
        # CPU: one worker per torch thread, each running its group of sequences with single-threaded ops
        # (not with Triton on CPU: the Triton interpreter is not thread-safe)
        self.num_parts = (torch.get_num_threads() if device.type == "cpu" and not use_triton and self.tp.size == 1
                          else 1)
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}  # request id -> this step's (take_prompt_logprobs)
        self._pool = (ThreadPoolExecutor(self.num_parts, thread_name_prefix="kvfleet-forward",
                                         initializer=torch.set_num_threads, initargs=(1,))
                      if self.num_parts > 1 else None)
        log.info("paths%s: %s", f" of rank {self.tp.rank}" if self.tp.size > 1 else "",
                 "; ".join(f"{k}: {v}" for k, v in self.paths().items()))

    @property
    def vocab_size(self) -> int:
        return self.model.arch.vocab_size

    def paths(self) -> dict[str, str]:
        """The implementation each hot operation takes here (chosen once, by the CPU's instruction sets and
        the linear-layer calibration): for the start log and the benchmarks' reports."""
        ops, dtype, head_dim = self.model.ops, self.dtype, self.model.arch.head_dim

        from gpu_worker.executor.ops.cpu import kernels

        def impl(fn) -> str:
            module = getattr(fn, "__module__", "")
            if module.endswith("native_ops"):
                return f"native {kernels.describe()}"
            return "triton" if module.startswith("kernels") else "torch"

        attention = impl(ops.paged_attention)
        prefill = attention
        if attention.startswith("native") and not kernels.prefill_covers(head_dim):
            prefill = f"torch SDPA (no native kernel for head dim {head_dim} here)"
        elif attention.startswith("native") and dtype == torch.bfloat16 and head_dim % 32 == 0 and kernels.amx():
            prefill += ", on AMX tiles"
        return {"linear": (self.linear_plan.describe(dtype) if self.linear_plan is not None
                           else "F.linear (torch)"),
                "decode attention": attention, "prefill attention": prefill,
                "norm, rotary, activation, KV store": impl(ops.rms_norm),
                "decode steps": ("every layer in one native call (decode_stack)" if self.model.decode_stack is not None
                                 else "layer by layer in Python"),
                "forwards per step": "1" if self.num_parts == 1 else (
                    f"{self.num_parts} concurrent, 1 thread each" + (
                        f"; one on all threads for steps under {self.linear_plan.one_forward_below} tokens"
                        " (their matmuls split the columns: measured faster here)"
                        if self.linear_plan is not None and self.linear_plan.splits_columns(1) else "")),
                **({"allocator": self.allocator} if self.allocator is not None else {})}

    def fault(self) -> str | None:
        """Why this runner cannot go on (a tensor-parallel runner's dead rank); a single process: never."""
        return None

    def take_prompt_logprobs(self) -> dict[str, PromptLogprobs]:
        """The prompt logprobs the forwards since the last call scored, by request id (a step retried in parts
        after a failure adds those of each part that ran)."""
        out, self._prompt_logprobs = self._prompt_logprobs, {}
        return out

    def close(self) -> None:
        self.kv_prefault.stop()
        if self._pool is not None:
            self._pool.shutdown()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> block dst in every layer.

        A dst now holds initialised data (src was zeroed when first used), so it is marked zeroed: the lazy
        zeroing of blocks a block table names for the first time, which runs after this, must not wipe the copy.
        """
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]
        self._zeroed[[d for _, d in pairs]] = True

    def _zero_new_blocks(self, block_tables: torch.Tensor) -> None:
        """block_tables: [S, max_blocks] on the CPU; zero the blocks never seen before."""
        fresh = block_tables[~self._zeroed[block_tables]]
        if fresh.numel():
            fresh = fresh.unique().long()
            self._zeroed[fresh] = True
            fresh = fresh.to(self.device)
            for key_cache, value_cache in self.kv_caches:
                key_cache[fresh] = 0
                value_cache[fresh] = 0

    def prepare_inputs(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                 torch.Tensor]:
        lens = [len(s.token_ids) for s in seqs]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        max_blocks = max(len(s.block_table) for s in seqs)
        dev = self.device

        def t(data, dtype):
            return torch.tensor(data, dtype=dtype).to(dev, non_blocking=True)

        block_tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs],
                                    dtype=torch.int32)  # [S, max_blocks]

        input_ids = t(list(chain.from_iterable(s.token_ids for s in seqs)), torch.long)  # [T]
        positions = t([p for s in seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))],
                      torch.long)  # [T]
        meta = AttentionMetadata(
            slot_mapping=t(list(chain.from_iterable(s.slot_mapping for s in seqs)), torch.long),  # [T]
            block_tables=block_tables.to(dev, non_blocking=True),
            query_start_loc=t(starts, torch.int32),  # [S + 1]
            context_lens=t([s.start_pos + n for s, n in zip(seqs, lens, strict=True)], torch.int32),  # [S]
        )
        sample_rows = t([starts[i + 1] - 1 for i, s in enumerate(seqs) if s.sample], torch.long)  # [N]
        return input_ids, positions, meta, sample_rows

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """-> logits [num sample=True seqs, vocab] float32, in batch order."""
        self.copy_blocks(sched.blocks_to_copy)
        if not sched.seqs:
            return torch.empty(0, self.vocab_size, device=self.device)
        if self._zero_fresh_blocks:
            width = max(len(s.block_table) for s in sched.seqs)
            self._zero_new_blocks(torch.tensor([s.block_table + [0] * (width - len(s.block_table))
                                                for s in sched.seqs], dtype=torch.int32))  # [S, width]
        seqs = sched.seqs
        parts = [seqs]
        one_forward = self.linear_plan is not None and self.linear_plan.splits_columns(sched.num_batched_tokens)
        if self._pool is not None and not one_forward:
            parts = split_batch(seqs, self.num_parts, self.block_size)
        if len(parts) == 1:
            return self._forward(seqs)
        futures = [self._pool.submit(self._forward, [seqs[i] for i in part]) for part in parts]
        # each part's logits are for its sampling sequences in its order: put them back in batch order
        sample_row = {i: n for n, i in enumerate(i for i, s in enumerate(seqs) if s.sample)}
        rows = torch.tensor([sample_row[i] for part in parts for i in part if seqs[i].sample], dtype=torch.long)
        logits = torch.cat([f.result() for f in futures])  # [N, V] in part order
        return torch.empty_like(logits).index_copy_(0, rows.to(logits.device), logits)  # [N, V] in batch order

    def _forward(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """One forward over `seqs` -> logits of its sampling sequences [N, V] (inference mode is per thread)."""
        with torch.inference_mode():
            input_ids, positions, meta, sample_rows = self.prepare_inputs(seqs)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, H]
            logits = self.model.compute_logits(hidden[sample_rows])  # [N, V]
            start = 0
            for s in seqs:
                if s.prompt_logprob_targets:
                    rows = hidden[start:start + len(s.prompt_logprob_targets)]
                    self._prompt_logprobs[s.request_id] = PromptLogprobs(s.start_pos + 1, *score_rows(
                        self.model.compute_logits, rows, s.prompt_logprob_targets, s.num_prompt_logprobs))
                start += len(s.token_ids)
            return logits
