"""LLM: the offline API, shaped like vllm.LLM. `LLM("smollm2").generate(prompts, SamplingParams(...))`.

It returns complete outputs: the engine's per-step deltas folded together (outputs.OutputAccumulator).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from gpu_worker.core.policies import SchedulingPolicy
from gpu_worker.engine.llm_engine import LLMEngine
from gpu_worker.engine.outputs import OutputAccumulator, RequestOutput
from shared.sampling_params import SamplingParams

Prompt = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]} (optionally with "prompt")
Message = dict[str, Any]  # {"role", "content"}, and an assistant turn's "tool_calls", a tool's "tool_call_id"


class LLM:
    def __init__(self, model: str, *, dtype: str = "float32", device: str = "cpu", block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: str | int | None = None,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, scheduling_policy: str | SchedulingPolicy = "fcfs",
                 seed: int = 0, tensor_parallel_size: int = 1, **engine_kwargs: Any):
        self.engine = LLMEngine.from_model(
            model, dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, scheduling_policy=scheduling_policy, seed=seed,
            tensor_parallel_size=tensor_parallel_size, **engine_kwargs)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, as vLLM's `LLM.reset_prefix_cache` (LLMEngine.reset_prefix_cache)."""
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine's executor processes (tensor_parallel_size > 1) and threads now rather than at exit."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: pass one, or one "
                                 f"per prompt")
        ids = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                text, token_ids = self._tokenize(prompt)
                rid = str(next(self._counter))
                self.engine.add_request(rid, token_ids, sp, prompt=text)
                ids.append(rid)
        except BaseException:  # one bad prompt: none of this call's requests stay queued
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template: the
        model's, or `chat_template` (Jinja text, a file, or one kvfleet ships: "chatml-tools"), shown `tools` (OpenAI
        tool definitions) where the template shows them. The answers are text, as vLLM's LLM.chat."""
        from shared.models import chat_template_text

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        template = chat_template_text(chat_template) if chat_template else None
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=template, tools=tools)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer(prompt)["input_ids"]
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], self.engine.tokenizer(prompt["prompt"])["input_ids"]
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', got keys "
                         f"{sorted(prompt)}")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        running = {rid: OutputAccumulator() for rid in request_ids}
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        num_out = 0
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    acc = running.get(delta.request_id)
                    if acc is None:
                        continue  # queued on the engine by someone else
                    acc.add(delta)
                    if delta.finished:
                        out = finished[delta.request_id] = acc.result()
                        del running[delta.request_id]
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"]
                        if elapsed:
                            bar.set_postfix_str(f"output {num_out / elapsed:.1f} tok/s", refresh=False)
        except BaseException:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]
