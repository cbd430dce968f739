"""Baseline: Hugging Face transformers `generate` in static batches, run as its own process.

`python -m services.bench.peer_hf REQUESTS.json --dtype float32 --batch-size 16 --threads 2` reads the peer-file
form of a workload (Workload.to_peer_json: "model" is a local Hugging Face directory) and prints one line
`RESULT {json}`. Greedy (or its "sampling"), left padding; each batch runs until its longest request's output_len (every row
gets that many tokens, only output_len of them count). Like ../shared/peers/bench_hf.py, which produced the
figures in issue 3.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from shared.settings import hf_offline


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.bench.peer_hf")
    ap.add_argument("requests_json")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--progress", action="store_true", help="a progress bar on stderr")
    args = ap.parse_args(argv)
    hf_offline()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    with open(args.requests_json) as f:
        wl = json.load(f)
    reqs = wl["requests"]
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(wl["model"])
    model = AutoModelForCausalLM.from_pretrained(wl["model"], dtype=getattr(torch, args.dtype)).eval()
    load_s = time.perf_counter() - t0
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    s = wl.get("sampling") or {"temperature": 0.0}
    # greedy, or sampled with the same parameters (top_k 0: off, as in kvfleet; generate's default is 50)
    sampling = {"do_sample": False} if s["temperature"] == 0 else {
        "do_sample": True, "temperature": s["temperature"], "top_p": s["top_p"], "top_k": s["top_k"]}

    def generate(batch: list[dict], new_tokens: int) -> tuple[torch.Tensor, int]:
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, L], left padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, L]
        for i, r in enumerate(batch):
            p = r["prompt_token_ids"]
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=pad_id, **sampling)
        return out[:, width:], ids.numel()  # [B, new_tokens]

    generate(reqs[:2], 4)  # warm-up (not timed), as the vLLM baseline does
    batches = [reqs[i:i + args.batch_size] for i in range(0, len(reqs), args.batch_size)]
    bar = None
    if args.progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(r["output_len"] for r in reqs), desc="HF generate", unit="tok", file=sys.stderr)
    n_out = padded_in = 0
    t1 = time.perf_counter()
    for batch in batches:
        new_tokens = max(r["output_len"] for r in batch)
        new, padded = generate(batch, new_tokens)
        assert new.shape[1] == new_tokens, (new.shape, new_tokens)
        padded_in += padded
        n_out += sum(r["output_len"] for r in batch)
        if bar is not None:
            bar.update(sum(r["output_len"] for r in batch))
    wall = time.perf_counter() - t1
    if bar is not None:
        bar.close()
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    result = {
        "system": f"HF generate (static batches of {args.batch_size})", "dtype": args.dtype,
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": args.threads,
        "sampling": s, "num_requests": len(reqs), "prompt_tokens": n_in, "padded_prompt_tokens": padded_in,
        "output_tokens": n_out, "load_s": round(load_s, 2), "wall_s": round(wall, 3),
        "output_tok_per_s": n_out / wall, "total_tok_per_s": (n_in + n_out) / wall,
        "peak_rss_bytes": _peak_rss_bytes(),
    }
    print("RESULT " + json.dumps(result), flush=True)


def _peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM, which starts again at exec. (getrusage's ru_maxrss does not: a child
    reports its parent's peak when that was higher, and the parent here is the benchmark, kvfleet's engine
    included.)"""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    main()
