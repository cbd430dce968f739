"""The simulated model runner (gpu_worker.executor.simulated_runner) with the real sampler: the profile's step
cost is what it sleeps, and its tokens are the cost model's, whatever the sampling parameters; the shipped
profiles load; calibrate's non-negative fit recovers known coefficients; `kvfleet up --simulate` passes the
profile to every worker."""

from __future__ import annotations

import math
import random

import pytest
import torch

from gpu_worker.core.sched_output import ScheduledSeq, SchedulerOutput
from gpu_worker.engine.sampler import Sampler, SamplingRow
from gpu_worker.executor.cost_model import PROFILE_DIR, CostProfile, StepShape, sim_token
from gpu_worker.executor.simulated_runner import LOSER_LOGIT, SimulatedRunner
from services.bench.calibrate import Sample, fit_nonnegative
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

VOCAB = 1000
PROFILE = CostProfile("test", a_s=0.005, b_s_per_prefill_token=2e-4, c_s_per_decode_seq=1e-3,
                      d_s_per_context_token=1e-6, e_s_per_prefill_pair=1e-7, num_kv_blocks=64)


def runner(**kw) -> tuple[SimulatedRunner, list[float]]:
    slept: list[float] = []
    kw.setdefault("avoid_ids", {0, 1, 2})
    return SimulatedRunner(PROFILE, vocab_size=VOCAB, block_size=16, num_blocks=64, sleep=slept.append, **kw), slept


def seq(rid: str, n_tokens: int, start: int, sample: bool = True) -> ScheduledSeq:
    blocks = list(range(-(-(start + n_tokens) // 16)))
    return ScheduledSeq(rid, list(range(3, 3 + n_tokens)), start, blocks,
                        [start + i for i in range(n_tokens)], sample)


def step() -> SchedulerOutput:
    """A prefill chunk that does not sample, a prefill that does, and two decodes."""
    return SchedulerOutput(seqs=[seq("chunk", 32, 0, sample=False), seq("p", 10, 0), seq("d1", 1, 40),
                                 seq("d2", 1, 7)])


def test_a_step_costs_what_the_profile_says_and_sleeps_no_longer():
    r, slept = runner()
    sched = step()
    logits = r.execute(sched)
    # the prefills' attention: 32 tokens from position 0 (32 * 33 / 2 query-key pairs), then 10 (10 * 11 / 2)
    shape = StepShape(prefill_tokens=42, decode_seqs=2, context_tokens=32 + 10 + 41 + 8, prefill_pairs=528 + 55)
    assert r.last_shape == shape
    assert r.last_step_s == pytest.approx(PROFILE.step_seconds(shape))
    assert r.last_step_s == pytest.approx(0.005 + 42 * 2e-4 + 2 * 1e-3 + 91 * 1e-6 + 583 * 1e-7)
    assert len(slept) == 1 and 0 < slept[0] <= r.last_step_s  # less the time the call itself took
    assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32


def test_the_step_counts_from_when_the_engine_began_it():
    r, slept = runner()
    r.step_started = 0.0  # long ago: the budget is spent, no sleep
    r.execute(step())
    assert slept == [] and r.last_sleep_s == 0.0 and r.step_started is None
    r.execute(step())  # the next step counts from its own call again
    assert len(slept) == 1


def test_an_empty_step_costs_nothing():
    r, slept = runner()
    assert r.execute(SchedulerOutput(blocks_to_copy=[(1, 2)])).shape == (0, VOCAB)
    assert slept == []


def test_tokens_are_a_function_of_seed_request_and_position():
    r, _ = runner()
    logits = r.execute(step())
    chosen = logits.argmax(dim=-1).tolist()
    # the token generated sits right after the context: positions 10, 41 and 8
    assert chosen == [sim_token(0, "p", 10, VOCAB, r.avoid), sim_token(0, "d1", 41, VOCAB, r.avoid),
                      sim_token(0, "d2", 8, VOCAB, r.avoid)]
    assert chosen == [r.token("p", 10), r.token("d1", 41), r.token("d2", 8)]
    again, _ = runner()
    assert again.execute(step()).argmax(dim=-1).tolist() == chosen
    other_seed, _ = runner(seed=7)
    assert other_seed.execute(step()).argmax(dim=-1).tolist() != chosen
    assert set(logits.unique().tolist()) == {0.0, LOSER_LOGIT}


def test_tokens_avoid_the_given_ids_and_stay_in_the_token_range():
    r, _ = runner(avoid_ids=set(range(0, 400)), token_range=500)
    tokens = {r.token(f"req-{i}", p) for i in range(50) for p in range(20)}
    assert tokens <= set(range(400, 500)) and len(tokens) > 50


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=2.0, seed=5),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.5, min_p=0.2),
    SamplingParams(temperature=1.0, repetition_penalty=0.1, presence_penalty=-2.0, frequency_penalty=-2.0),
    SamplingParams(temperature=1.0, logit_bias={17: 100.0}, logprobs=3),
], ids=["greedy", "seeded", "filters", "penalties", "bias-logprobs"])
def test_the_sampler_picks_the_simulated_token_whatever_the_parameters(params):
    r, _ = runner()
    sched = step()
    logits = r.execute(sched)
    want = logits.argmax(dim=-1).tolist()
    rng = random.Random(0)
    rows = []
    for _ in want:
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        outputs = [rng.randrange(VOCAB) for _ in range(30)] + want  # seen tokens: the penalties apply to them
        rows.append(SamplingRow(params, [3, 4, 5], outputs, [], generator))
    out = Sampler(seed=1)(logits, rows)
    assert out.token_ids == want
    if params.logprobs:
        for tok, lp in zip(want, out.logprobs, strict=True):
            assert lp[tok] == pytest.approx(0.0, abs=1e-3)
            assert all(math.isfinite(v) for v in lp.values())  # logprobs serialize as JSON numbers


def test_every_shipped_profile_loads_and_says_where_it_comes_from():
    names = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
    assert "smollm2-cpu" in names
    for name in names:
        prof = CostProfile.load(name)
        assert prof.name == name
        assert prof.source.startswith(("calibrated: ", "derived from published figures", "hand-written: "))
        assert min(prof.a_s, prof.b_s_per_prefill_token, prof.c_s_per_decode_seq, prof.d_s_per_context_token) >= 0
        # every step costs something, but in the zero profile (the gateway's benchmark: no step costs anything)
        assert (prof.step_seconds(StepShape(0, 1, 100)) > 0) == (name != "zero")
        assert CostProfile.load(f"{name}.json") == prof  # the file's name in profiles/ names it too
    with pytest.raises(ValueError, match="smollm2-cpu"):
        CostProfile.load("no-such-profile")
    with pytest.raises(ValueError, match="smollm2-cpu"):
        CostProfile.load("some/dir/zero.json")  # a path is a path: not looked up in profiles/


def test_the_fit_recovers_known_coefficients():
    truth = (0.01, 3e-4, 2e-3, 5e-7, 2e-8)
    rng = random.Random(0)
    samples = []
    for _ in range(80):
        prefill, cached = rng.choice([0, 0, 64, 512, 1024]), rng.choice([0, 512])
        shape = StepShape(prefill, rng.randrange(0, 64), rng.randrange(0, 40000),
                          prefill * cached + prefill * (prefill + 1) // 2)
        if shape.prefill_tokens == shape.decode_seqs == 0:
            continue
        t = (truth[0] + truth[1] * shape.prefill_tokens + truth[2] * shape.decode_seqs
             + truth[3] * shape.context_tokens + truth[4] * shape.prefill_pairs)
        samples.append(Sample(shape, t * rng.uniform(0.98, 1.02)))
    fit = fit_nonnegative(samples)
    for got, want in zip(fit.coefficients, truth, strict=True):
        assert got == pytest.approx(want, rel=0.15)
    assert fit.r2 > 0.99 and fit.mean_rel_error < 0.03
    assert set(fit.rel_error_by_kind) <= {"prefill", "decode", "mixed"}


def test_the_fit_never_gives_a_negative_coefficient():
    """Times that fall with the context (noise): a free fit gives d < 0; the kept fit drops that term."""
    samples = [Sample(StepShape(0, 8, ctx), 0.05 - 1e-7 * ctx) for ctx in range(1000, 20000, 1000)]
    samples += [Sample(StepShape(256, 0, 256), 0.08), Sample(StepShape(512, 0, 512), 0.11)]
    fit = fit_nonnegative(samples)
    assert min(fit.coefficients) >= 0
    assert fit.coefficients[3] == 0.0


def test_kvfleet_up_passes_simulate_to_every_worker():
    from services.cli import build_parser
    from services.launcher import fleet_commands
    from shared.settings import Settings

    args = build_parser().parse_args(["up", "--workers", "3", "--simulate", "smollm2-cpu"])
    cmds = fleet_commands(args, Settings(model="smollm2"), private=True)
    workers = [cmd for name, cmd in cmds if name != "gateway"]
    assert len(workers) == 3
    for cmd in workers:
        assert cmd[cmd.index("--simulate") + 1] == "smollm2-cpu"
        assert "--block-size" not in cmd  # the profile's scheduler limits apply unless given


def test_prompt_logprobs_score_the_simulated_models_choices():
    """Where the prompt holds the token the simulated model would choose there, its logprob is ~0; elsewhere
    LOSER_LOGIT less. The top N lead with that choice. Each row is a distribution: the probabilities sum to 1."""
    r, _ = runner()
    choice = [r.token("a", p) for p in range(1, 5)]
    targets = [choice[0], (choice[1] + 1) % VOCAB, choice[2], 5]
    s = ScheduledSeq("a", [3, 4, 5, 6], 0, [0], [0, 1, 2, 3], False, targets, 3)
    r.execute(SchedulerOutput([s]))
    (scored,) = r.take_prompt_logprobs().values()
    assert scored.first_position == 1 and r.take_prompt_logprobs() == {}
    assert scored.ranks == [1, 2, 1, 1 if targets[3] == choice[3] else 2]
    for i, entry in enumerate(scored.entries):
        want = 0.0 if targets[i] == choice[i] else LOSER_LOGIT
        assert entry[targets[i]] == pytest.approx(want, abs=1e-6)
        assert max(entry, key=entry.get) == choice[i] and len(entry) in (3, 4)
        others = r.vocab_size - 1
        assert math.exp(entry[choice[i]]) + others * math.exp(LOSER_LOGIT + entry[choice[i]]) == pytest.approx(1.0)
