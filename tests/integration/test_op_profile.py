"""`kvfleet bench throughput --profile-ops`: the profile of a real engine run on the tiny Llama splits the time by
step kind and by operation, its parts add up, and detaching leaves the engine as it was (same functions, same
tokens)."""

import pytest

from gpu_worker import LLM, SamplingParams
from gpu_worker.engine import isolation
from gpu_worker.executor.ops.cpu import linear as cpu_linear
from services.bench.op_profile import OPS, OpProfile, format_profile

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("stack", [False, True])
def test_profile_of_a_run(tiny_llama_dir, monkeypatch, stack):
    """Decode steps layer by layer in Python (a oneDNN plan), or through the native decode stack (the panel GEMM's
    plan), which times the same op kinds inside its call."""
    from gpu_worker.executor.ops.cpu import kernels as cpu_kernels

    if stack and not cpu_kernels.gemm_available():
        pytest.skip("no panel GEMM on this CPU: no native decode stack")
    plan = cpu_linear.LinearPlan("panel", None, False) if stack else cpu_linear.LinearPlan("onednn", None, False)
    monkeypatch.setattr(cpu_linear, "calibrate", lambda weight, layer=(): plan)
    llm = LLM(str(tiny_llama_dir), block_size=4, num_kv_blocks=64, max_model_len=128)
    assert (llm.engine.runner.model.decode_stack is not None) == stack
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(3)]
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine, ops = llm.engine, llm.engine.runner.model.ops
    originals = ([getattr(ops, n) for n in OPS], cpu_linear.linear, isolation.sample)

    profile = OpProfile().attach(engine)
    during = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    profile.detach()

    assert during == before
    assert ([getattr(ops, n) for n in OPS], cpu_linear.linear, isolation.sample) == originals
    assert "execute" not in vars(engine.runner) and "step" not in vars(engine)
    if stack:
        assert engine.runner.model.decode_stack.on_profile is None
    report = profile.report()
    assert set(report) == {"prefill", "decode"}
    assert report["prefill"]["steps"] >= 1 and report["decode"]["steps"] >= 5  # 3 prompts x 5 more tokens
    for r in report.values():
        assert 0 < r["forward_s"] <= r["step_s"] and r["between_forwards_s"] >= 0
        ops_s = r["ops_thread_s"]
        assert ops_s["linear"] > 0 and ops_s["paged_attention"] > 0 and ops_s["other"] > -1e-3
        assert sum(ops_s.values()) == pytest.approx(r["forward_thread_s"])
    assert "prefill:" in format_profile(report) and "linear" in format_profile(report)
