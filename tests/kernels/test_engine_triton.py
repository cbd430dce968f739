"""The engine gives the same greedy tokens with the Triton kernels (interpreter on CPU) as with the torch ops,
on a tiny Llama (GQA, llama3 rope scaling) through chunked prefill, a prefix-cache hit and decode steps."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.engine.llm import LLM
from gpu_worker.executor.ops import OP_NAMES
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.kernels

PREFIX = [(7 * i) % 500 + 20 for i in range(21)]  # 21 shared tokens: 2 full blocks of 8 cached, then mid-block
PROMPTS = [PREFIX + [901, 902, 903], PREFIX + [777], [5, 6, 7], [(13 * i) % 900 + 3 for i in range(30)]]


def generate(model_dir, device, use_triton: bool) -> tuple[LLM, list]:
    llm = LLM(str(model_dir), device=str(device), block_size=8, num_kv_blocks=64, max_num_batched_tokens=24,
              max_model_len=96, use_triton=use_triton)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    first = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)  # fills the prefix cache
    rest = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params, use_tqdm=False)
    return llm, [out.outputs[0] for out in first + rest]


def test_engine_tokens_equal_with_kernels(tiny_llama_dir, device):
    torch_llm, expected = generate(tiny_llama_dir, device, use_triton=False)
    triton_llm, actual = generate(tiny_llama_dir, device, use_triton=True)
    import kernels

    model_ops = triton_llm.engine.runner.model.ops
    assert all(getattr(model_ops, name) is getattr(kernels, name) for name in OP_NAMES)
    assert triton_llm.engine.stats().prefix_cache_hits > 0  # a chunk continued after cached blocks
    assert [c.token_ids for c in actual] == [c.token_ids for c in expected]
    assert all(len(c.token_ids) == 6 for c in actual)
    chosen = [[lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)] for c in actual + expected]
    n = len(actual)
    torch.testing.assert_close(torch.tensor(chosen[:n]), torch.tensor(chosen[n:]), atol=1e-4, rtol=1e-4)
