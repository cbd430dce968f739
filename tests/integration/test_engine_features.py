"""The engine's request features on a tiny Llama: stop strings / ids, max/min tokens, n > 1 with shared
blocks, seeds across batch compositions, resume, rejection, unsupported architectures, chat."""

import dataclasses

import pytest
import torch

from gpu_worker import LLM, LLMEngine, SamplingParams
from gpu_worker.core.sched_output import ScheduledSeq, SchedulerOutput
from gpu_worker.core.scheduler import RequestRejected
from gpu_worker.engine.outputs import OutputAccumulator
from gpu_worker.executor.model_loader import UnsupportedArchitecture, load_model_files
from gpu_worker.executor.model_runner import ModelRunner
from gpu_worker.executor.ops.cpu import kernels as cpu_kernels

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = list(range(300, 321))  # 21 tokens


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=96, max_num_batched_tokens=64, max_model_len=96)


def gen(llm, prompt, **kw):
    kw.setdefault("temperature", 0)
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def step_into(engine, accumulators):
    """One engine step; its deltas folded into accumulators (request id -> OutputAccumulator)."""
    for delta in engine.step():
        accumulators.setdefault(delta.request_id, OutputAccumulator()).add(delta)


def run_all(engine):
    """Step until the engine is idle; the complete output of every request it ran."""
    accumulators = {}
    while engine.has_unfinished_requests():
        step_into(engine, accumulators)
    return {rid: acc.result() for rid, acc in accumulators.items()}


def test_max_tokens_and_text(llm):
    out = gen(llm, PROMPT, max_tokens=7, ignore_eos=True)
    assert len(out.token_ids) == 7 and out.finish_reason == "length" and out.stop_reason is None
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


def test_stop_token_ids(llm):
    ref = gen(llm, PROMPT, max_tokens=16, ignore_eos=True).token_ids
    stop_id = ref[4]
    first = ref.index(stop_id)
    out = gen(llm, PROMPT, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id])
    assert out.token_ids == ref[: first + 1]  # the stop id is kept in token_ids ...
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == llm.get_tokenizer().decode(ref[:first])  # ... but not in the text


def test_min_tokens_masks_stop_ids(llm):
    ref = gen(llm, PROMPT, max_tokens=16, ignore_eos=True).token_ids
    stop_id = ref[1]
    out = gen(llm, PROMPT, max_tokens=16, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=6)
    assert len(out.token_ids) >= 6
    assert stop_id not in out.token_ids[:5]
    assert out.finish_reason == "length" or out.token_ids[-1] == stop_id


def test_stop_strings(llm):
    ref = gen(llm, PROMPT, max_tokens=16, ignore_eos=True).text
    stop = ref[len(ref) // 2: len(ref) // 2 + 3]
    cut = ref.index(stop)
    out = gen(llm, PROMPT, max_tokens=16, ignore_eos=True, stop=[stop, "never appears \u2603"])
    assert out.text == ref[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    inc = gen(llm, PROMPT, max_tokens=16, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert inc.text == ref[: cut + len(stop)]


def test_streaming_holds_back_a_possible_stop_string(llm):
    engine = llm.engine
    ref = gen(llm, PROMPT, max_tokens=12, ignore_eos=True)
    text_at_6 = llm.get_tokenizer().decode(ref.token_ids[:6])
    stop = text_at_6[-3:] + "\u2603"  # the text after 6 tokens ends with the start of this stop string
    engine.add_request("hold", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    streamed, tokens, text = {}, [], ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.outputs[0].token_ids
            text += o.outputs[0].text
            streamed[len(tokens)] = text
    assert streamed[6] == text_at_6[:-3]  # held back: the next token might complete the stop string
    assert streamed[12] == ref.text  # finished: everything is released
    assert all(ref.text.startswith(t) for t in streamed.values())


def test_n_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request("group", PROMPT, params)
    accumulators, peak_used = {}, 0
    while engine.has_unfinished_requests():
        step_into(engine, accumulators)
        peak_used = max(peak_used, engine.stats().used_blocks)
    (out,) = [acc.result() for acc in accumulators.values()]
    assert out.finished and out.request_id == "group"
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    prompt_blocks = len(PROMPT) // 4
    assert peak_used < 3 * prompt_blocks  # 3 sequences, one copy of the prompt's full blocks


GROUP_BS = 8
GROUP_LENGTHS = (1, 5, GROUP_BS - 1, GROUP_BS, GROUP_BS + 1)  # 1 token, less than a block, around one block
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def fresh_llm(model_dir):
    """A new engine: its KV blocks were never used, so none is lazily zeroed yet (as on a fresh worker)."""
    return LLM(str(model_dir), block_size=GROUP_BS, num_kv_blocks=64, max_num_batched_tokens=256, max_model_len=64)


def prompt_of(length, base=300):
    return list(range(base, base + length))


@pytest.fixture(scope="module")
def n1_output(tiny_llama_dir):
    ref, memo = fresh_llm(tiny_llama_dir), {}

    def output(prompt):
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = gen(ref, prompt, max_tokens=8, ignore_eos=True).token_ids
        return memo[tuple(prompt)]
    return output


@pytest.mark.parametrize("n", [2, 3])
def test_greedy_n_samples_all_equal_the_n1_output(tiny_llama_dir, n1_output, n):
    # Regression: the leader (and all but the last sibling) write the last prompt token into a copy-on-write
    # copy of the shared partial block; the runner zeroed that never-used copy after copying into it.
    llm = fresh_llm(tiny_llama_dir)
    prompts = [prompt_of(length) for length in GROUP_LENGTHS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        dataclasses.replace(GREEDY, n=n), use_tqdm=False)
    for length, p, out in zip(GROUP_LENGTHS, prompts, outs, strict=True):
        assert [c.token_ids for c in out.outputs] == [n1_output(p)] * n, f"prompt of {length} tokens"


def test_greedy_n_samples_equal_the_n1_output_in_a_mixed_batch(tiny_llama_dir, n1_output):
    engine = fresh_llm(tiny_llama_dir).engine
    waves = [  # (request id, prompt, n): groups fork while other requests prefill and decode
        [("o0", prompt_of(12, 500), 1), ("g5", prompt_of(5), 3)],
        [("g1", prompt_of(1), 2), ("g7", prompt_of(GROUP_BS - 1), 2), ("o1", prompt_of(3, 600), 1)],
        [("g8", prompt_of(GROUP_BS), 3), ("o2", prompt_of(20, 700), 1), ("g9", prompt_of(GROUP_BS + 1), 2)],
    ]
    accumulators = {}
    for wave in waves:
        for rid, p, n in wave:
            engine.add_request(rid, p, dataclasses.replace(GREEDY, n=n))
        step_into(engine, accumulators)
    engine.add_request("t", prompt_of(6, 800), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8))
    while engine.has_unfinished_requests():
        step_into(engine, accumulators)
    done = {rid: acc.result() for rid, acc in accumulators.items()}
    for rid, p, n in (r for wave in waves for r in wave):
        assert done[rid].finished
        assert [c.token_ids for c in done[rid].outputs] == [n1_output(p)] * n, rid
    assert engine.stats().used_blocks == 0


def test_runner_keeps_a_copy_on_write_destination_it_has_not_zeroed_yet(tiny_llama_dir):
    runner = ModelRunner(load_model_files(tiny_llama_dir), dtype=torch.float32, device=torch.device("cpu"),
                         max_model_len=64, block_size=4, num_kv_blocks=4)
    runner.execute(SchedulerOutput([ScheduledSeq("a", [5, 6, 7], 0, [0], [0, 1, 2], sample=False)]))
    # block 1 is named by a block table for the first time in the step that copies block 0 into it
    runner.execute(SchedulerOutput([ScheduledSeq("b", [8], 3, [1], [7], sample=True)], blocks_to_copy=[(0, 1)]))
    for key_cache, value_cache in runner.kv_caches:  # [num_blocks, block_size, Hkv, D] each
        assert key_cache.shape[2] > 1 and cpu_kernels.kv_layout(key_cache, value_cache) == 1  # CPU: head-major
        assert key_cache[0, :3].abs().sum() > 0
        assert torch.equal(key_cache[1, :3], key_cache[0, :3]) and torch.equal(value_cache[1, :3], value_cache[0, :3])
        assert key_cache[1, 3].abs().sum() > 0  # the step's own token landed in the copy


def test_seeded_request_is_reproducible_across_batches(llm):
    target = {"prompt_token_ids": PROMPT}
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": list(range(700, 700 + n))} for n in (3, 30, 11)]
    batch = others[:2] + [target] + others[2:]
    mixed = llm.generate(batch, [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 2 + [params]
                         + [SamplingParams(temperature=1.0, seed=5, max_tokens=3)], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    unseeded = llm.generate([target] * 2, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 99)])
def test_resume_output_token_ids_continues_the_same_tokens(llm, temperature, seed):
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=10, ignore_eos=True)
    full = gen(llm, PROMPT, temperature=temperature, seed=seed, max_tokens=10, ignore_eos=True)
    head = gen(llm, PROMPT, temperature=temperature, seed=seed, max_tokens=4, ignore_eos=True)  # sent before
    assert head.token_ids == full.token_ids[:4]
    engine = llm.engine
    engine.add_request("resumed", PROMPT, params, resume_output_token_ids=[full.token_ids[:4]])
    rest = run_all(engine)["resumed"].outputs[0]  # the tokens after the resumed ones, none of those again
    assert head.token_ids + rest.token_ids == full.token_ids
    assert head.text + rest.text == full.text


def test_too_long_prompt_is_rejected(llm):
    with pytest.raises(RequestRejected, match="max_model_len 96"):
        llm.engine.add_request("long", list(range(90)), SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="prompt is 97 tokens >= max_model_len 96"):
        llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": list(range(97))}],
                     SamplingParams(max_tokens=None), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the good prompt of that call was withdrawn too
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        llm.engine.add_request("oov", [5, 10**7], SamplingParams())


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("gone", PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats().used_blocks > 0
    engine.abort_request("gone")
    assert not engine.has_unfinished_requests() and engine.stats().used_blocks == 0


def test_metrics_and_chat(llm):
    out = llm.chat([{"role": "user", "content": "Hi there"}], SamplingParams(temperature=0, max_tokens=4),
                   use_tqdm=False)[0]
    assert "<|im_start|>user\nHi there<|im_end|>" in out.prompt
    assert out.prompt_token_ids == llm.get_tokenizer()(out.prompt, add_special_tokens=False)["input_ids"]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLMEngine.from_model(str(tmp_path))


def test_missing_model_says_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="Hugging Face directory.*gguf.*smollm2"):
        LLMEngine.from_model(str(tmp_path / "nope"))


def test_runner_names_its_paths(llm, caplog):
    """The path each hot operation takes is decided once and said once (the start log, the benchmarks' header):
    on a CPU the native kernels, named by the instruction sets they were built with."""
    from gpu_worker.executor.ops.cpu import kernels

    paths = llm.engine.runner.paths()
    assert set(paths) == {"linear", "decode attention", "prefill attention", "norm, rotary, activation, KV store",
                          "decode steps", "forwards per step", "allocator"}
    # the native decode stack where every op of a layer is native and the few-rows matmuls are the panel GEMM's
    stack = llm.engine.runner.linear_plan.few_rows == "panel"
    assert paths["decode steps"] == ("every layer in one native call (decode_stack)" if stack
                                     else "layer by layer in Python")
    assert paths["allocator"].startswith("glibc malloc keeps freed memory")  # the image and CI run glibc
    isa = kernels.isa()
    flags = open("/proc/cpuinfo").read()
    assert ("avx512" in isa) == (" avx512f" in flags) and isa != "none"
    assert paths["decode attention"] == f"native {isa}"
    # tiny Llama: head dim 16, which the AVX-512 and the AVX2 prefill kernels cover
    assert paths["prefill attention"] == (f"native {isa}" if isa != "scalar" else
                                          "torch SDPA (no native kernel for head dim 16 here)")
    assert paths["linear"].startswith(("oneDNN packed", "kvfleet's panel GEMM"))
