"""The fleet simulator's workloads: seeded, generated request lists with Poisson arrivals and exact output
lengths (as with `ignore_eos`). Prompts are token-id lists, so shared prefixes hit the workers' real prefix
caches.

  shared-prefix  many users over a few long system prompts (by default 8 of 1-2k tokens; `system_prompts`
                 and `system_tokens` make more and longer ones, as many tenants' would be) with short
                 user suffixes, and multi-turn chats: each turn's prompt is the previous turn's prompt, the
                 reply it got and a new user message, so it extends the conversation token for token (the
                 reply's tokens are the simulated model's, gpu_worker.executor.cost_model.sim_token).
  long-context   mostly short requests and some long documents (6-14k tokens), none sharing a prefix: they
                 press on KV memory, so a worker that is sent too many long ones preempts.

Arrivals are Poisson at `rate`, except a chat's next turn: it is drawn THINK_S or more after the previous
turn's arrival, and the simulator holds it until the previous turn has finished and its user has read the
reply for MIN_THINK_S (`after`): nobody sends the next turn of a chat before seeing the answer.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from gpu_worker.executor.cost_model import sim_token

WORKLOADS = ("shared-prefix", "long-context")
VOCAB_SIZE = 49152  # SmolLM2's; prompt ids are drawn from [FIRST_ID, VOCAB_SIZE)
FIRST_ID = 100  # below it: the special tokens
SYSTEM_PROMPTS = 8  # the default count and lengths of the shared-prefix workload's system prompts
SYSTEM_TOKENS = (1024, 2048)
CHAT_SHARE = 0.7  # of shared-prefix arrivals: a chat turn (else a one-shot request on a system prompt)
THINK_S = 2.0  # a chat's next turn arrives at least this long after its previous one
MIN_THINK_S = 1.0  # ... and at least this long after the previous turn finished
MAX_CHAT_TURNS = 10
MAX_CHAT_TOKENS = 12288  # a chat ends before its prompt and reply would pass this


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt: list[int]
    output_len: int
    kind: str  # "system", "chat" or "long" / "short"
    after: str | None = None  # a chat's previous turn: this one is sent MIN_THINK_S after that one finished


@dataclass
class _Chat:
    prompt: list[int]
    last_id: str
    last_output: int
    last_arrival: float
    turns: int


def generate(workload: str, *, rate: float, seed: int, num_requests: int | None = None,
             duration_s: float | None = None, token_seed: int = 0, system_prompts: int = SYSTEM_PROMPTS,
             system_tokens: tuple[int, int] = SYSTEM_TOKENS) -> list[SimRequest]:
    """`num_requests` requests, or those arriving within `duration_s`, at `rate` per second (Poisson).
    `token_seed` is the simulated model's seed (the replies chats build on)."""
    if workload not in WORKLOADS:
        raise ValueError(f"--workload must be one of {WORKLOADS}, got {workload!r}")
    if rate <= 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    if (num_requests is None) == (duration_s is None):
        raise ValueError("give exactly one of --num-requests and --duration")
    if system_prompts < 1 or not 1 <= system_tokens[0] <= system_tokens[1]:
        raise ValueError(f"--system-prompts must be >= 1 and --system-prompt-tokens LO-HI with 1 <= LO <= HI, got "
                         f"{system_prompts} and {system_tokens[0]}-{system_tokens[1]}")
    rng = random.Random(seed)
    make = (_SharedPrefix(rng, token_seed, system_prompts, system_tokens) if workload == "shared-prefix"
            else _LongContext(rng))
    out: list[SimRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if (num_requests is not None and len(out) >= num_requests) or (duration_s is not None and t > duration_s):
            return out
        out.append(make.next(f"r{len(out)}", t))


def from_bench_workload(name: str, *, rate: float, seed: int, num_requests: int | None,
                        vocab_size: int = VOCAB_SIZE) -> list[SimRequest]:
    """A fixed workload of `kvfleet bench serve` (../shared/workloads/*.jsonl, peer64), with the arrival times
    bench serve gives it at the same --request-rate and --seed: the simulator replays a real run's load
    request for request (how its predictions are checked against real workers)."""
    from services.bench.stats import poisson_arrivals
    from services.bench.workload import load_workload

    if rate <= 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    reqs = load_workload(name, vocab_size=vocab_size, num_requests=num_requests, seed=seed).requests
    arrivals = poisson_arrivals(len(reqs), rate, seed)
    return [SimRequest(f"r{i}", t, list(r.prompt_token_ids), r.output_len, "fixed")
            for i, (r, t) in enumerate(zip(reqs, arrivals, strict=True))]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB_SIZE) for _ in range(n)]


class _SharedPrefix:
    def __init__(self, rng: random.Random, token_seed: int, count: int, lengths: tuple[int, int]):
        self.rng, self.token_seed = rng, token_seed
        self.systems = [_tokens(rng, rng.randint(*lengths)) for _ in range(count)]
        self.chats: deque[_Chat] = deque()  # open chats, oldest turn first

    def next(self, rid: str, t: float) -> SimRequest:
        rng = self.rng
        if rng.random() >= CHAT_SHARE:
            prompt = rng.choice(self.systems) + _tokens(rng, rng.randint(32, 256))
            return SimRequest(rid, t, prompt, rng.randint(32, 256), "system")
        out = rng.randint(64, 256)
        ready = self.chats and self.chats[0].last_arrival <= t - THINK_S
        after = None
        if ready and rng.random() < 0.8:  # the next turn of the chat that has waited longest
            chat = self.chats.popleft()
            after = chat.last_id
            reply = [sim_token(self.token_seed, chat.last_id, i, VOCAB_SIZE) for i in range(chat.last_output)]
            chat.prompt = chat.prompt + reply + _tokens(rng, rng.randint(64, 512))
        else:
            chat = _Chat(rng.choice(self.systems) + _tokens(rng, rng.randint(64, 512)), "", 0, t, 0)
        chat.last_id, chat.last_output, chat.last_arrival = rid, out, t
        chat.turns += 1
        if chat.turns < MAX_CHAT_TURNS and len(chat.prompt) + out + 512 + 256 <= MAX_CHAT_TOKENS:
            self.chats.append(chat)
        return SimRequest(rid, t, chat.prompt, out, "chat", after)


class _LongContext:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def next(self, rid: str, t: float) -> SimRequest:
        rng = self.rng
        if rng.random() < 0.25:
            return SimRequest(rid, t, _tokens(rng, rng.randint(6144, 14336)), rng.randint(256, 1024), "long")
        return SimRequest(rid, t, _tokens(rng, rng.randint(256, 1536)), rng.randint(128, 512), "short")
