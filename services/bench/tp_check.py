"""Tensor-parallel launch check, for a machine with N GPUs (services/bench/device_check_tp.sh runs it there) and
for CPU (gloo) in the tests:

1. a random-weight Llama (8 query heads over 4 KV heads, saved as a Hugging Face directory with a word-level
   tokenizer: no download, no GGUF) generates greedily on one device, then split over N ranks;
2. the tokens must be the same and the chosen tokens' logprobs within --tolerance;
3. one executor rank is killed with SIGKILL: the runner must report it (`fault()`) and the next step must raise
   EngineFault, each within 10 s, and nothing may be left running.

    python -m services.bench.tp_check [--device cuda] [--tensor-parallel-size 2] [--json PATH]

Prints one line per check and a JSON summary; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from shared.settings import hf_offline

hf_offline()

PROMPTS = [[5, 17, 42, 99, 3], list(range(100, 140)), [7], list(range(300, 365))]
MAX_TOKENS = 16


def randomize(model, std: float = 0.08) -> None:
    """Weights with a wider spread than transformers' init (less flat, more varied text): matrices N(0, std),
    biases N(0, 0.02), norm weights U(0.8, 1.2)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
            else:
                p.uniform_(0.8, 1.2)


def make_model(out: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with random weights and a word-level tokenizer over its 512 ids, saved to `out`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2",
                                                unk_token="t0", pad_token="t2")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out


def _generate(model: Path, device: str, tp: int):
    from gpu_worker import LLM, SamplingParams

    llm = LLM(str(model), device=device, block_size=16, num_kv_blocks=64, max_model_len=256,
              tensor_parallel_size=tp)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0),
                        use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                                      strict=True)]) for o in outs]


def run(device: str, tp: int, tolerance: float) -> dict:
    from gpu_worker.engine.llm_engine import EngineFault
    from shared.sampling_params import SamplingParams

    report: dict = {"device": device, "tensor_parallel_size": tp, "checks": {}}
    checks = report["checks"]
    with tempfile.TemporaryDirectory(prefix="kvfleet-tp-check-") as tmp:
        model = make_model(Path(tmp) / "tiny-llama")
        one, want = _generate(model, device, 1)
        one.close()
        t0 = time.monotonic()
        llm, got = _generate(model, device, tp)
        report["start_and_generate_s"] = round(time.monotonic() - t0, 2)
        worst = max(abs(a - b) for (_, la), (_, lb) in zip(want, got, strict=True) for a, b in zip(la, lb, strict=True))
        checks["same_tokens"] = all(a == b for (a, _), (b, _) in zip(want, got, strict=True))
        checks["logprobs_within_tolerance"] = worst <= tolerance
        report["max_logprob_diff"] = worst
        executor = llm.engine.runner.procs[0]
        os.kill(executor.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.fault() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        checks["dead_rank_reported"] = llm.engine.fault() is not None
        llm.engine.add_request("after-the-kill", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2))
        t1 = time.monotonic()
        try:
            llm.engine.step()
            checks["next_step_is_engine_fault"] = False
        except EngineFault:
            checks["next_step_is_engine_fault"] = time.monotonic() - t1 < 10
        llm.close()
        checks["nothing_left_running"] = not multiprocessing.active_children()
    report["ok"] = all(checks.values())
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cuda (rank r on cuda:r, NCCL) or cpu (gloo)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=2, help="ranks (GPUs on cuda)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest logprob difference allowed")
    p.add_argument("--json", type=Path, help="write the report here too")
    args = p.parse_args(argv)
    report = run(args.device, args.tensor_parallel_size, args.tolerance)
    for name, ok in report["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
