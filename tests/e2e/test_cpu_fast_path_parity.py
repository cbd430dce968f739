"""The default model on the CPU fast path the benchmark measures: two torch threads (the runner splits each
step into two concurrent forwards, or, for steps of few tokens when the matmuls split their columns across
threads, runs one forward on both), 16-token blocks (the AVX-512 / AVX2 decode-attention kernel), packed
matmuls. Greedy tokens still equal Hugging Face transformers' generate, float32."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker import LLM, SamplingParams
from gpu_worker.executor.model_loader import load_model_files
from gpu_worker.executor.ops.cpu import linear as cpu_linear
from services.bench.workload import load_workload

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12


@pytest.mark.parametrize("mode", ["as_calibrated", "always_split", "one_forward_for_decode"])
def test_split_steps_match_hf(two_torch_threads, mode, monkeypatch):
    if mode != "as_calibrated":
        one_below = 0 if mode == "always_split" else cpu_linear.CALIBRATION_ROWS // 2
        monkeypatch.setattr(cpu_linear.LinearPlan, "splits_columns", lambda self, num_rows: num_rows < one_below)
    prompts = [r.prompt_token_ids[:96] for r in load_workload("peer64", vocab_size=49152).requests[:6]]
    llm = LLM("smollm2", block_size=16, num_kv_blocks=64, max_num_batched_tokens=128, max_num_seqs=8,
              max_model_len=256)
    assert llm.engine.runner.num_parts == 2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(load_model_files("smollm2").weights_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for p, out in zip(prompts, outs, strict=True):
            g = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                            do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=2)
            c = out.outputs[0]
            assert c.token_ids == g.sequences[0, len(p):].tolist()
            lps = torch.stack(g.logits)[:, 0].log_softmax(-1)
            assert max(abs(lp[t] - lps[i, t].item())
                       for i, (lp, t) in enumerate(zip(c.logprobs, c.token_ids, strict=True))) < 1e-3
