"""Loading checkpoints the ways users ship them (sharded safetensors), the CLI command, and incremental
detokenization with the real tokenizer."""

import argparse

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine.detokenizer import IncrementalDetokenizer, backend_decode
from services import generate_cmd

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = list(range(400, 420))


def greedy(model_dir):
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=32, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_safetensors_load_like_one_file(tiny_qwen2_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    (tmp_path / "tokenizer.json").write_bytes((tiny_qwen2_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_bytes((tiny_qwen2_dir / "tokenizer_config.json").read_bytes())
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert greedy(tmp_path) == greedy(tiny_qwen2_dir)


def test_generate_command_prints_the_text(tiny_llama_dir, capsys):
    parser = argparse.ArgumentParser()
    generate_cmd.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--prompt", "Hello there", "--max-tokens", "5",
                              "--ignore-eos", "--num-kv-blocks", "16", "--max-model-len", "64"])
    assert generate_cmd.run(args) == 0
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, max_model_len=64)
    want = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == want + "\n"


def test_generate_command_rejects_bad_params(tiny_llama_dir, capsys):
    parser = argparse.ArgumentParser()
    generate_cmd.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_llama_dir), "--prompt", "x", "--top-p", "0"])
    assert generate_cmd.run(args) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("backend", [False, True])
def test_incremental_detokenization_matches_a_full_decode(tiny_llama_dir, backend):
    """With transformers' decode, and with the tokenizers library's own where the engine takes it
    (backend_decode: a fast tokenizer that does not clean up spaces, as this one)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = " Grüße aus Köln 🌍🚀 — naïve café, 東京タワー!\n  indented <|im_end|> done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prompt = tok("Say:", add_special_tokens=False)["input_ids"]
    decode = backend_decode(tok) if backend else None
    assert (decode is not None) == backend
    detok = IncrementalDetokenizer(tok, prompt, decode=decode)
    pieces = []
    for i in ids:
        detok.add_tokens([i])
        pieces.append(detok.take_text(finished=False))
        assert "\ufffd" not in pieces[-1]  # half a character is never shown
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)  # the whole text, in pieces
    assert detok.take_text(finished=True) == ""  # nothing was held back: there are no stop strings


def test_the_runner_owns_its_plan(tiny_llama_dir):
    """Two runners in one process each calibrate and hold their own plan; the module keeps no state."""
    from gpu_worker.executor.model_loader import load_model_files
    from gpu_worker.executor.model_runner import ModelRunner
    from gpu_worker.executor.ops.cpu import linear as cpu_linear

    files = load_model_files(tiny_llama_dir)
    runners = [ModelRunner(files, dtype=torch.float32, device=torch.device("cpu"), max_model_len=64,
                           block_size=16, num_kv_blocks=8) for _ in range(2)]
    assert all(isinstance(r.linear_plan, cpu_linear.LinearPlan) for r in runners)
    assert runners[0].linear_plan is not runners[1].linear_plan
    layer = runners[0].model.layers[0]
    assert layer.packed["gate_up"].kind == runners[0].linear_plan.few_rows
    for name, packed in layer.packed.items():  # a loaded weight no path reads is let go
        assert (getattr(layer, f"{name}_weight") is None) == (not packed.reads_weight), name
    assert not [name for name, value in vars(cpu_linear).items()
                if isinstance(value, cpu_linear.LinearPlan | cpu_linear.PackedWeight)]



@pytest.mark.parametrize("family, tied", [("llama", True), ("qwen2", False)])
def test_a_tied_lm_head_keeps_one_packed_form(request, family, tied):
    """The embedding stays for the lookup, so a tied lm_head gets only the few-rows layout for every row count (no
    second form for many rows); an untied one takes the plan's two paths like every weight. Both give the
    logits of the weight itself."""
    from gpu_worker.executor.model_loader import load_model_files
    from gpu_worker.executor.models.llama import LlamaForCausalLM
    from gpu_worker.executor.ops.cpu import linear as cpu_linear

    files = load_model_files(request.getfixturevalue(f"tiny_{family}_dir"))
    model = LlamaForCausalLM(files.config, max_positions=64, dtype=torch.float32)
    model.load_weights(files.weights())
    assert (model.lm_head is None) == tied
    head = (model.embed if tied else model.lm_head).detach().clone()
    model.pack_weights(cpu_linear.LinearPlan("onednn", "aten", False))
    packed = model.lm_head_packed
    assert packed.kind == "onednn" and packed.many == (None if tied else "aten")
    assert model.layers[0].packed["o"].many == "aten"  # the decoder's weights: both paths, tied or not
    hidden = torch.randn(300, model.arch.hidden_size)  # many rows: the few-rows path when tied
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ head.T, atol=1e-4, rtol=1e-5)
