"""The engine's request features on a tiny Llama: stop strings / ids, max/min tokens, n > 1 with shared
blocks, seeds across batch compositions, resume, rejection, unsupported architectures, chat."""

import pytest
import torch

from gpu_worker import LLM, LLMEngine, SamplingParams
from gpu_worker.model_loader import UnsupportedArchitecture
from gpu_worker.scheduler import RequestRejected

pytestmark = pytest.mark.integration

PROMPT = list(range(300, 321))  # 21 tokens


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=96, max_num_batched_tokens=64, max_model_len=96)


def gen(llm, prompt, **kw):
    kw.setdefault("temperature", 0)
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


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
    streamed = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed[len(o.outputs[0].token_ids)] = o.outputs[0].text
    assert streamed[6] == text_at_6[:-3]  # held back: the next token might complete the stop string
    assert streamed[12] == ref.text  # finished: everything is released
    assert all(ref.text.startswith(t) for t in streamed.values())


def test_n_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request("group", PROMPT, params)
    outputs, peak_used = [], 0
    while engine.has_unfinished_requests():
        outputs = engine.step() or outputs
        peak_used = max(peak_used, engine.stats().used_blocks)
    (out,) = outputs
    assert out.finished and out.request_id == "group"
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    prompt_blocks = len(PROMPT) // 4
    assert peak_used < 3 * prompt_blocks  # 3 sequences, one copy of the prompt's full blocks


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
    engine = llm.engine
    engine.add_request("resumed", PROMPT, params, resume_output_token_ids=[full.token_ids[:4]])
    last = None
    while engine.has_unfinished_requests():
        last = engine.step() or last
    assert last[0].outputs[0].token_ids == full.token_ids
    assert last[0].outputs[0].text == full.text


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
