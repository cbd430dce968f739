"""`kvfleet worker` with faults injected, for tests/integration/test_poison_requests.py. Everything is the real
worker except these hooks, keyed on what a client can send (the seed), so the same poison works straight
into a stream and through the gateway:

  seed FORWARD_SEED   the model runner raises whenever the request is in the batch (a forward that fails
                      without naming a culprit: the engine bisects)
  seed SAMPLER_SEED   the sampler raises whenever the request's row is in the batch (the engine samples
                      row by row)
  seed DETOK_SEED     detokenizing the request's tokens raises
  seed HANG_SEED      the model runner never returns whenever the request is in the batch (the engine hangs:
                      the worker's watchdog must notice)
  a cancel of KILL_CANCEL_THREAD  the cancel reader thread dies (SystemExit is not an error it survives)

    python tests/fault_worker.py --model DIR --worker-id W [kvfleet worker flags]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FORWARD_SEED, SAMPLER_SEED, DETOK_SEED, HANG_SEED = 4242, 4343, 4444, 4545
KILL_CANCEL_THREAD = "kill-the-cancel-thread"


def install() -> None:
    from gpu_worker.engine.llm_engine import LLMEngine
    from gpu_worker.engine.sampler import Sampler
    from gpu_worker.executor.model_runner import ModelRunner
    from gpu_worker.serve.intake import Cancel, Intake
    from shared import streams

    forward_poison: set[str] = set()
    hanging: set[str] = set()
    add_request, execute, sample = LLMEngine.add_request, ModelRunner.execute, Sampler.__call__
    process = LLMEngine._process_new_tokens

    def add_request_hook(self, request_id, prompt_token_ids, params, **kw):
        if params.seed == FORWARD_SEED:
            forward_poison.update({request_id} | {f"{request_id}-{i}" for i in range(params.n)})
        if params.seed == HANG_SEED:
            hanging.add(request_id)
        return add_request(self, request_id, prompt_token_ids, params, **kw)

    def execute_hook(self, sched):
        if any(s.request_id in forward_poison for s in sched.seqs):
            raise RuntimeError("injected forward fault")
        while any(s.request_id in hanging for s in sched.seqs):
            time.sleep(1)  # an injected hang: the forward never returns (and holds no lock the writer needs)
        return execute(self, sched)

    def sample_hook(self, logits, rows):
        if any(r.params.seed == SAMPLER_SEED for r in rows):
            raise RuntimeError("injected sampler fault")
        return sample(self, logits, rows)

    def process_hook(self, s, logprob):
        if s.request.sampling_params.seed == DETOK_SEED:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return process(self, s, logprob)

    def read_cancels_hook(self):
        self._cancel_from, request_ids = streams.read_cancels(self.r, self._cancel_from)
        if KILL_CANCEL_THREAD in request_ids:
            raise SystemExit("injected thread death")
        for request_id in request_ids:
            self.inbox.put(Cancel(request_id))

    LLMEngine.add_request, ModelRunner.execute, Sampler.__call__ = add_request_hook, execute_hook, sample_hook
    LLMEngine._process_new_tokens = process_hook
    Intake._read_cancels_once = read_cancels_hook


if __name__ == "__main__":
    install()
    from services.cli import main

    sys.exit(main(["worker", *sys.argv[1:]]))
