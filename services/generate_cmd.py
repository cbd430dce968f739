"""Generate text offline with kvfleet's engine (no fleet, no Redis) and print it.

Example: kvfleet generate --prompt "Write a haiku about Redis" --chat --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="Hugging Face directory, .gguf file, or the default model's alias")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat the flag for several prompts, batched together)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=128, help='tokens to generate per sample')
    parser.add_argument("--min-tokens", type=int, default=0, help='tokens to generate before EOS / stop ids may end a sample')
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help='nucleus sampling: keep the smallest set of tokens with this total probability')
    parser.add_argument("--top-k", type=int, default=0, help='keep only the k most likely tokens (0: off)')
    parser.add_argument("--min-p", type=float, default=0.0, help='drop tokens less likely than min_p times the most likely one')
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help='divide logits of tokens seen in prompt or output (>1 discourages repeats)')
    parser.add_argument("--presence-penalty", type=float, default=0.0, help='subtract from logits of tokens already generated')
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help='subtract this times the count of each generated token')
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--ignore-eos", action="store_true", help='keep generating past the end-of-sequence token')
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help='weights and KV cache dtype')
    parser.add_argument("--device", default="cpu", help='cpu or cuda')
    parser.add_argument("--block-size", type=int, default=16, help='tokens per KV-cache block')
    parser.add_argument("--num-kv-blocks", type=int, default=None, help='KV cache size in blocks (default: sized from free memory)')
    parser.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 1GiB")
    parser.add_argument("--max-model-len", type=int, default=None, help="context window: prompt + output tokens (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help='most sequences in one batch')
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help='token budget of one engine step (prefill chunks + decodes)')
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar")


def run(args: argparse.Namespace) -> int:
    import torch

    from gpu_worker.engine.llm import LLM
    from shared.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens, stop=args.stop,
            ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    except ValueError as e:
        print(f"kvfleet generate: {e}", file=sys.stderr)
        return 2
    llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
              num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        outputs = llm.chat([system + [{"role": "user", "content": p}] for p in args.prompt], params,
                           use_tqdm=args.progress)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=args.progress)
    for out in outputs:
        for completion in out.outputs:
            if len(outputs) > 1 or len(out.outputs) > 1:
                print(f"--- prompt {out.request_id}, sample {completion.index} ({completion.finish_reason})")
            print(completion.text)
    return 0
