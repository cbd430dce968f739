"""A step reuses the memory the step before it freed: no page is faulted in again (gpu_worker.executor.host_malloc).

The default model in bfloat16 on two torch threads, 64 sequences decoding: each step allocates and frees the
same activations, among them the 12.6 MB of float32 logits. With glibc's default thresholds the decode steps
here faulted ~520 pages each in again (2-core Zen 5); the runner's malloc settings bring that to none. Page
faults are counted by the kernel (getrusage), not timed, so a noisy machine does not change the result.
"""

import resource

import pytest

from gpu_worker import LLM, SamplingParams
from services.bench.workload import load_workload

pytestmark = pytest.mark.e2e

NUM_SEQS = 64


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_decode_steps_fault_no_freed_memory_in_again(two_torch_threads):
    llm = LLM("smollm2", dtype="bfloat16", block_size=16, num_kv_blocks=320, max_num_batched_tokens=2048,
              max_num_seqs=NUM_SEQS, max_model_len=512)
    engine = llm.engine
    assert engine.runner.paths()["allocator"].startswith("glibc malloc keeps freed memory")
    for key_cache, value_cache in engine.runner.kv_caches:  # resident, as a worker's is (kv_prefault): the
        key_cache.zero_()  # cache's own first touches are not what this counts
        value_cache.zero_()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, r in enumerate(load_workload("peer64", vocab_size=49152).requests[:NUM_SEQS]):
        engine.add_request(str(i), r.prompt_token_ids[:32], params)
    per_step = []
    while engine.has_unfinished_requests():
        before = _faults()
        outputs = engine.step()
        per_step.append(_faults() - before)
        assert outputs is not None
    decode = per_step[3:-1]  # past the prefill and the first decode steps, before the last (it frees)
    assert len(decode) >= 16
    decode.sort()
    assert decode[len(decode) // 2] <= 16, f"page faults per decode step: {decode}"
