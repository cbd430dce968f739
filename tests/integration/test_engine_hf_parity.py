"""Greedy tokens and logprobs equal Hugging Face transformers' generate on the same tiny checkpoints, with a
cache small enough to preempt, a token budget small enough to chunk prefills, and shared prefixes."""

import dataclasses

import pytest
import torch
from tiny_models import hf_greedy
from transformers import AutoModelForCausalLM

from gpu_worker import LLM, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


MAX_TOKENS = 10
SHARED = list(range(1000, 1013))  # 13 tokens: 3 full blocks of 4 shared between prompts
PROMPTS = [
    list(range(200, 205)),
    SHARED + [7, 8, 9],
    list(range(3000, 3031)),  # 31 tokens: chunked by the 16-token budget
    SHARED + [11],
    [42],
    SHARED + list(range(500, 510)),
]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_batch_matches_hf(kind, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=22, max_num_batched_tokens=16, max_num_seqs=6,
              max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the cache was meant to be too small for the whole batch"
    assert stats.prefix_cache_hits > 0, "the shared prefix was meant to hit the prefix cache"
    for (want_ids, want_lps), out in zip(hf_greedy(model_dir, PROMPTS, MAX_TOKENS), outs, strict=True):
        c = out.outputs[0]
        assert c.token_ids == want_ids
        assert c.finish_reason == "length"
        got_lps = [lp[t] for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(got_lps, want_lps, strict=True)) < 1e-3
        assert c.cumulative_logprob == pytest.approx(sum(want_lps), abs=1e-2)
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def test_repetition_penalty_matches_hf(tiny_llama_dir):
    """vLLM's and HF's repetition penalty agree: divide positive / multiply negative logits of every token
    seen in prompt or output."""
    prompt = list(range(300, 320))
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=128)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
                       use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    want = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          repetition_penalty=1.8, pad_token_id=2)[0, len(prompt):].tolist()
    assert out.token_ids == want
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert plain.token_ids != want  # the penalty changed something


def _hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: HF's log-softmax at each position but the last (what predicts prompt[i + 1])."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prompt_logprobs_match_hf(kind, request):
    """Each prompt token's logprob and the top N there equal HF's, with the prompt computed in chunks (a 16-token
    budget), a prefix that the cache already holds (scored anyway: a hit has no logits), a small cache that
    preempts, and n=2 (both samples carry the same list)."""
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=22, max_num_batched_tokens=16, max_num_seqs=6,
              max_model_len=128)
    llm.generate([{"prompt_token_ids": SHARED + [1]}], SamplingParams(max_tokens=1), use_tqdm=False)  # cached
    prompts = [SHARED + list(range(500, 530)), list(range(3000, 3031)), [42, 43], [7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0, "the cache was meant to be too small for the batch at once"
    outs += llm.generate({"prompt_token_ids": prompts[0]}, dataclasses.replace(params, n=2, temperature=1.0, seed=3),
                         use_tqdm=False)
    for prompt, out in zip(prompts + [prompts[0]], outs, strict=True):
        got, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
        assert len(got) == len(ranks) == len(prompt) and got[0] is None and ranks[0] is None
        if len(prompt) == 1:
            continue
        want = _hf_prompt_logprobs(model_dir, prompt)
        for i, entry in enumerate(got[1:]):
            target = prompt[i + 1]
            assert entry[target] == pytest.approx(want[i, target].item(), abs=1e-3)
            top_vals, top_ids = want[i].topk(3)
            for t, v in zip(top_ids.tolist(), top_vals.tolist(), strict=True):
                assert entry[t] == pytest.approx(v, abs=1e-3)
            assert set(entry) == {target, *top_ids.tolist()}
            # 1 + how many are likelier, up to float noise among near-equal logits
            v = want[i, target]
            assert int((want[i] > v + 1e-3).sum()) < ranks[i + 1] <= int((want[i] > v - 1e-3).sum()) + 1


def test_a_scored_context_gives_the_next_scoring_requests_a_prefix_hit_and_the_same_logprobs(tiny_llama_dir):
    """lm-eval's multiple choice: one context, a continuation per choice, one request after another. The first
    scores the context; the next ones take a prefix-cache hit over its full blocks, their logprobs there from
    ScoredPrefixes (gpu_worker/engine/scored_prefixes.py), and every list equals HF's. Another top N, or prefix
    caching off, scores it all again."""
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=128)
    context = list(range(2000, 2023))  # 23 tokens: 5 full blocks, then 3 tokens in the sixth
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    prompts = [context + [5, 6], context + [7], context + [8, 9, 10]]
    outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    # positions 0-20 are known from the first: its blocks 0-4, and the token after them (the context's 2020,
    # predicted by row 19), so the hit covers the 5 blocks
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 20, 20]
    assert llm.engine.scored_prefixes.hits == 12
    edgeless = llm.generate({"prompt_token_ids": context[:20] + [9]}, params, use_tqdm=False)[0]
    assert edgeless.metrics.num_cached_tokens == 16  # 9 never followed those blocks: row 19 is computed again
    other_n = llm.generate({"prompt_token_ids": context + [11]}, dataclasses.replace(params, prompt_logprobs=3),
                           use_tqdm=False)[0]
    assert other_n.metrics.num_cached_tokens == 0
    for prompt, out, top_n in zip(prompts + [context[:20] + [9], context + [11]], outs + [edgeless, other_n],
                                  [2, 2, 2, 2, 3], strict=True):
        want = _hf_prompt_logprobs(tiny_llama_dir, prompt)
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for i, entry in enumerate(got[1:]):
            assert entry[prompt[i + 1]] == pytest.approx(want[i, prompt[i + 1]].item(), abs=1e-3)
            assert set(want[i].topk(top_n)[1].tolist()) <= set(entry) and len(entry) <= top_n + 1
    off = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=128, enable_prefix_caching=False)
    scored = [off.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts[:2]]
    assert off.engine.scored_prefixes is None and [o.metrics.num_cached_tokens for o in scored] == [0, 0]
    for a, b in zip(scored[1].prompt_logprobs[1:], outs[1].prompt_logprobs[1:], strict=True):
        assert set(a) == set(b) and all(a[k] == pytest.approx(b[k], abs=1e-4) for k in a)


def test_reset_prefix_cache_ends_the_hits_and_changes_no_token(tiny_llama_dir):
    """The same prompt again hits the prefix cache; after LLM.reset_prefix_cache it is computed again, with
    the same greedy tokens. While a request is unfinished the reset refuses and forgets nothing."""
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=32, max_model_len=128)
    prompt = {"prompt_token_ids": list(range(300, 317))}  # 17 tokens: 4 full blocks
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first, again = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert [first.metrics.num_cached_tokens, again.metrics.num_cached_tokens] == [0, 16]
    llm.engine.add_request("pending", prompt["prompt_token_ids"], params)
    assert not llm.reset_prefix_cache()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.reset_prefix_cache()
    after = llm.generate(prompt, params, use_tqdm=False)[0]
    assert after.metrics.num_cached_tokens == 0
    assert after.outputs[0].token_ids == first.outputs[0].token_ids == again.outputs[0].token_ids
