"""The KV cache's background pre-fault (gpu_worker.executor.kv_prefault): it makes the pages resident and
never changes what the engine wrote, even while the engine writes the same blocks; and an engine serving
while it runs gives the same greedy tokens as one with it off; the warm-up returns with the cache resident."""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from gpu_worker.engine.llm_engine import LLMEngine
from gpu_worker.executor.kv_prefault import KVPrefault
from shared.sampling_params import SamplingParams


def _fresh(blocks: int) -> tuple[torch.Tensor, torch.Tensor, mmap.mmap, mmap.mmap]:
    """A key and a value cache [blocks, 16, 2, 64] on pages of their own, never touched (a fresh anonymous map:
    torch.empty may reuse memory that earlier tests made resident)."""
    maps = [mmap.mmap(-1, blocks * 16 * 2 * 64 * 4) for _ in range(2)]
    k, v = (torch.frombuffer(m, dtype=torch.float32).view(blocks, 16, 2, 64) for m in maps)
    return k, v, maps[0], maps[1]


def _resident_share(t: torch.Tensor) -> float:
    """Share of the pages under `t` that are resident (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() & ~(page - 1)
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec) / pages


def test_pages_become_resident_and_contents_stay():
    blocks = 512
    caches, maps = [], []
    for _ in range(2):
        k, v, mk, mv = _fresh(blocks)
        caches.append((k, v))
        maps += [mk, mv]
    assert _resident_share(caches[1][1]) < 0.1, "a fresh map starts out of memory"
    caches[0][0][0].fill_(3.0)  # written before it starts
    caches[1][1][blocks - 1].fill_(-1.5)
    prefault = KVPrefault(caches, blocks)
    caches[1][0][7].fill_(2.0)  # written while it may be running
    assert prefault.wait(60)
    if not prefault.supported:  # a kernel before 5.14: nothing to check but that it said so and ended
        return
    assert prefault.blocks_done == blocks and prefault.seconds is not None
    for k, v in caches:
        assert _resident_share(k) == 1.0 and _resident_share(v) == 1.0, "every page of the caches is resident"
    assert bool((caches[0][0][0] == 3.0).all()) and bool((caches[1][1][blocks - 1] == -1.5).all())
    assert bool((caches[1][0][7] == 2.0).all())
    assert bool((caches[0][1] == 0.0).all()), "pages never written read as zeros"


def test_stop_ends_it_early():
    caches = [(torch.empty(4096, 16, 2, 64), torch.empty(4096, 16, 2, 64))]
    prefault = KVPrefault(caches, 4096)
    prefault.stop()
    assert prefault.wait(60)
    assert prefault.blocks_done <= 4096


def test_greedy_output_is_the_same_while_the_cache_is_made_resident(tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5 + i, 17, 3 * i + 1, 42, 9] * (i + 1) for i in range(6)]
    texts = []
    for prefault_kv in (False, True):
        engine = LLMEngine.from_model(str(tiny_llama_dir), num_kv_blocks=2048, prefault_kv=prefault_kv)
        if not prefault_kv:
            assert engine.runner.kv_prefault.done, "off: nothing runs"
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        assert engine.runner.kv_prefault.wait(60)
        engine.close()
        texts.append(out)
    assert texts[0] == texts[1]


def test_warm_up_returns_with_the_cache_resident(tiny_llama_dir):
    from gpu_worker.engine.warmup import warm_up

    engine = LLMEngine.from_model(str(tiny_llama_dir), num_kv_blocks=4096, prefault_kv=True)
    report = warm_up(engine)
    assert engine.runner.kv_prefault.done and report.kv_wait_s >= 0
    if engine.runner.kv_prefault.supported:
        assert engine.runner.kv_prefault.blocks_done == 4096
    engine.close()


def test_it_stops_while_the_machine_is_short_of_memory(monkeypatch):
    from gpu_worker.executor import kv_prefault

    monkeypatch.setattr(kv_prefault, "memory_low", lambda: True)
    caches = [(torch.empty(256, 16, 2, 64), torch.empty(256, 16, 2, 64))]
    prefault = KVPrefault(caches, 256)
    assert prefault.wait(60)
    assert prefault.blocks_done == 0 and prefault.seconds is None


def test_memory_low_is_under_a_tenth_of_the_total_or_one_gib():
    from gpu_worker.executor.kv_prefault import memory_low

    def meminfo(total_gib: float, available_gib: float) -> str:
        return (f"MemTotal:       {int(total_gib * 2**20)} kB\nMemFree:          1000 kB\n"
                f"MemAvailable:   {int(available_gib * 2**20)} kB\n")

    assert memory_low(meminfo(16, 1.5))  # under 1.6 GiB, a tenth
    assert not memory_low(meminfo(16, 4))
    assert memory_low(meminfo(4, 0.9))  # under 1 GiB
    assert not memory_low(meminfo(4, 1.5))
    assert not memory_low("MemTotal: 1 kB\n")  # cannot tell: go on
