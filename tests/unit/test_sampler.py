"""gpu_worker.engine.sampler on hand-made logits, each feature against a direct computation."""

import math

import pytest
import torch

from gpu_worker.engine import sampler
from gpu_worker.engine.sampler import Sampler, SamplingRow, _pick, apply_penalties, nucleus
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

V = 12


def row(params: SamplingParams, prompt=(), output=(), banned=(), seed=None) -> SamplingRow:
    gen = None
    if seed is not None:
        gen = torch.Generator()
        gen.manual_seed(seed)
    return SamplingRow(params, list(prompt), list(output), list(banned), gen)


def test_greedy_takes_the_first_of_tied_maxima_and_a_nan_as_argmax_does():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, nan, 5.0, nan], [-inf] * 4, [0.0, -0.0, 0.0, -1.0]])
    out = Sampler()(logits.clone(), [row(SamplingParams(temperature=0))] * 4)
    assert out.token_ids == logits.argmax(-1).tolist() == [1, 1, 0, 0]


def test_greedy_is_argmax_and_logprobs_are_raw():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.0)
    out = Sampler()(logits.clone(), [row(params)] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    lp = logits.log_softmax(-1)
    for i in range(3):
        top = lp[i].topk(3)
        want = {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)}
        assert out.logprobs[i].keys() == want.keys()
        for t, v in want.items():
            assert math.isclose(out.logprobs[i][t], v, abs_tol=1e-6)


def test_logprobs_include_the_chosen_token_outside_the_top_n():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0, logprobs=1, repetition_penalty=10.0)  # penalty moves argmax
    out = Sampler()(logits.clone(), [row(params, prompt=[0])]).token_ids  # 5 / 10 = 0.5 < 4
    assert out == [1]
    full = Sampler()(logits.clone(), [row(params, prompt=[0])]).logprobs[0]
    lp = logits.log_softmax(-1)[0]
    assert set(full) == {0, 1}  # chosen (1) + top-1 (0), raw logprobs
    assert math.isclose(full[1], float(lp[1]), abs_tol=1e-6)


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.zeros(2, V)
    logits[:, 3] = 10.0  # eos would win
    logits[:, 5] = 9.0  # then a stop id
    greedy = SamplingParams(temperature=0)
    out = Sampler()(logits.clone(), [row(greedy, banned=[3, 5]), row(greedy)])
    assert out.token_ids == [logits[0].clone().index_fill_(0, torch.tensor([3, 5]), -1e9).argmax().item(), 3]


def test_logit_bias_adds_to_the_logits_before_sampling():
    logits = torch.zeros(3, V)
    logits[:, 2] = 5.0
    pushed = SamplingParams(temperature=0, logit_bias={7: 6.0})  # 0 + 6 > 5: token 7 wins
    banned = SamplingParams(temperature=0, logit_bias={"2": -100.0}, logprobs=0)  # the argmax is pushed out
    plain = SamplingParams(temperature=0)
    out = Sampler()(logits.clone(), [row(pushed), row(banned), row(plain)])
    assert out.token_ids[0] == 7 and out.token_ids[1] != 2 and out.token_ids[2] == 2
    assert math.isclose(out.logprobs[1][out.token_ids[1]], float(logits[1].log_softmax(-1)[0]), abs_tol=1e-6)  # raw
    sampled = SamplingParams(temperature=1.0, logit_bias={4: 100.0})  # a draw too: e^100 outweighs the rest
    assert Sampler()(torch.zeros(1, V), [row(sampled, seed=3)]).token_ids == [4]


def test_penalties_match_direct_computation():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g)
    rows = [
        row(SamplingParams(repetition_penalty=1.5), prompt=[0, 1, 1], output=[2, 7]),
        row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[0, 4], output=[4, 4, 9]),
        row(SamplingParams(), prompt=[1], output=[1]),
    ]
    got = logits.clone()
    apply_penalties(got, rows)
    want = logits.clone()
    for t in {0, 1, 2, 7}:  # repetition over prompt + output
        want[0, t] = want[0, t] / 1.5 if want[0, t] > 0 else want[0, t] * 1.5
    want[1, 4] -= 0.25 * 2 + 0.5  # frequency x count + presence, over the output only (4 is also in the prompt)
    want[1, 9] -= 0.25 * 1 + 0.5
    torch.testing.assert_close(got, want)


def test_sampling_follows_the_filtered_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].repeat(4000, 1)
    params = SamplingParams(temperature=1.0, top_k=3)
    out = Sampler(seed=3)(logits, [row(params)] * 4000).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=4).float() / 4000
    want = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert counts[3] == 0
    torch.testing.assert_close(counts, want, atol=0.03, rtol=0)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]]).repeat(3000, 1)
    cold = Sampler(seed=0)(logits, [row(SamplingParams(temperature=0.25))] * 3000).token_ids
    p0 = 1 / (1 + math.exp(-4.0))  # softmax([4, 0])[0]
    assert abs(cold.count(0) / 3000 - p0) < 0.02


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    target = torch.randn(1, 50, generator=g)
    params = SamplingParams(temperature=1.0, seed=11)
    alone = Sampler(seed=0)(target.clone(), [row(params, seed=11)]).token_ids
    others = torch.randn(3, 50, generator=g)
    mixed_rows = [row(SamplingParams(temperature=0.7)), row(params, seed=11), row(SamplingParams(seed=3), seed=3),
                  row(SamplingParams(temperature=0))]
    mixed = Sampler(seed=99)(torch.cat([others[:1], target, others[1:]]), mixed_rows).token_ids
    assert mixed[1] == alone[0]
    # a sequence of draws from one generator is the same whatever runs next to it
    seq_a, seq_b = row(params, seed=11), row(params, seed=11)
    s = Sampler(seed=5)
    a = [s(target.clone(), [seq_a]).token_ids[0] for _ in range(8)]
    b = [s(torch.cat([others[:2], target]), [row(SamplingParams()), row(SamplingParams()), seq_b]).token_ids[2]
         for _ in range(8)]
    assert a == b
    assert len(set(a)) > 1  # really sampling


def _reference(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p by sorting the whole row: the probabilities [V] a token is drawn with."""
    vals, order = logits.sort(descending=True)
    if top_k:
        vals[top_k:] = float("-inf")
    probs = vals.softmax(dim=-1)
    probs[probs.cumsum(dim=-1) - probs >= top_p] = 0.0
    return torch.zeros_like(probs).scatter(0, order, probs / probs.sum())


def test_nucleus_keeps_the_right_tokens_and_flags_a_nucleus_past_the_candidates():
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    logits = probs.log().repeat(3, 1)
    top_k, top_p = torch.tensor([2, 0, 3]), torch.tensor([1.0, 0.7, 0.6])
    ids, weights, spill = nucleus(logits, top_k, top_p, size=6)
    kept = [sorted(i for i, w in zip(r, ws, strict=True) if w > 0) for r, ws in zip(ids.tolist(), weights.tolist(),
                                                                                   strict=True)]
    assert kept == [[0, 1], [0, 1, 2], [0, 1]]  # top-k 2; 0.40 + 0.25 < 0.7 needs a third; top-k 3 then top-p 0.6
    assert not spill.any()
    # row 1's nucleus holds 3 tokens: 2 candidates are too few; a batch's candidates cover its largest top_k (3)
    assert nucleus(logits[1:2], top_k[1:2], top_p[1:2], size=2)[2].tolist() == [True]
    assert nucleus(logits, top_k, top_p, size=2)[2].tolist() == [False, False, False]


@pytest.mark.parametrize("size", [4, 32, 300])
@pytest.mark.parametrize("top_ks", [[0] * 8, [0, 5, 0, 40, 0, 0, 3, 0]])
def test_nucleus_matches_a_sort_of_the_whole_vocabulary(size, top_ks):
    g = torch.Generator().manual_seed(size)
    logits = torch.randn(24, 300, generator=g) * torch.tensor([0.5, 2.0, 6.0]).repeat(8)[:, None]  # flat to peaked
    top_k = torch.tensor(top_ks * 3)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.99, 0.3, 0.8, 1e-3] * 3)
    ids, weights, spill = nucleus(logits.clone(), top_k, top_p, size)
    candidates = min(300, max(size, int(top_k.max())))  # a batch's candidates cover its largest top_k
    assert ids.shape == (24, candidates)
    for r in range(24):
        want = _reference(logits[r].clone(), int(top_k[r]), float(top_p[r]))
        fits = int((want > 0).sum()) <= candidates
        assert bool(spill[r]) == (not fits), r
        if fits:
            got = torch.zeros(300).scatter(0, ids[r], weights[r] / weights[r].sum())
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert bool(spill.any()) == (candidates < 300)  # the flat rows' nuclei hold most of the vocabulary


def test_min_p_keeps_tokens_above_its_share_of_the_top():
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    out = Sampler(seed=1)(probs.log().repeat(3000, 1), [row(SamplingParams(min_p=0.3))] * 3000).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=6).float() / 3000
    assert counts[3:].sum() == 0  # p >= 0.3 * 0.40 = 0.12 keeps the first three
    torch.testing.assert_close(counts[:3], probs[:3] / 0.8, atol=0.03, rtol=0)


def test_a_nucleus_past_the_candidates_is_drawn_from_the_whole_vocabulary(monkeypatch):
    monkeypatch.setattr(sampler, "CANDIDATES", (2, 4))  # the nucleus of 0.9 here holds 6 tokens: both sizes spill
    probs = torch.tensor([0.2, 0.18, 0.16, 0.14, 0.12, 0.1, 0.06, 0.04])
    out = Sampler(seed=4)(probs.log().repeat(6000, 1), [row(SamplingParams(top_p=0.9))] * 6000).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=8).float() / 6000
    assert counts[6:].sum() == 0
    torch.testing.assert_close(counts[:6], probs[:6] / 0.9, atol=0.02, rtol=0)


def test_pick_never_lands_on_a_zero_weight():
    weights = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 3)
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-24])
    assert _pick(weights.clone(), u).tolist() == [1, 3, 3]


def test_penalties_of_rows_of_different_lengths_match_a_dense_computation():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=g) * 3
    rows = []
    for r in range(6):
        prompt = torch.randint(0, 40, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        output = torch.randint(0, 40, (r * 3,), generator=g).tolist()  # 0 to 15 ids: padding of every width
        rows.append(row(SamplingParams(repetition_penalty=[1.0, 1.3, 0.8][r % 3], presence_penalty=0.4 * (r % 2),
                                       frequency_penalty=0.3 * (r > 2)), prompt=prompt, output=output))
    got = logits.clone()
    apply_penalties(got, rows)
    want = logits.clone()
    for r, x in enumerate(rows):
        seen = torch.zeros(40, dtype=torch.bool)
        seen[x.prompt_token_ids + x.output_token_ids] = True
        p = x.params.repetition_penalty
        want[r] = torch.where(seen, torch.where(want[r] > 0, want[r] / p, want[r] * p), want[r])
        counts = torch.bincount(torch.tensor(x.output_token_ids, dtype=torch.long), minlength=40).float()
        want[r] -= x.params.frequency_penalty * counts + x.params.presence_penalty * (counts > 0).float()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=3, min_p=0.1),
                                    SamplingParams(repetition_penalty=5e-324)])
def test_infinite_and_nan_logits_still_give_a_token_of_the_vocabulary(params):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(8))
    logits[0, 5] = float("inf")  # the certain token
    logits[1, :] = float("nan")  # nothing usable: still an id, never an error
    logits[2, 3] = float("nan")
    out = Sampler(seed=2)(logits, [row(params, prompt=[1, 2], output=[3])] * 4).token_ids
    assert all(0 <= t < V for t in out)
    assert out[2] != 3
    if params.repetition_penalty == 1.0:  # (5e-324 makes every seen token with a positive logit infinite too)
        assert out[0] == 5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_masked_token_stays_masked_under_the_smallest_repetition_penalty(temperature):
    """A banned (min_tokens) or grammar-masked token is -inf; a repetition_penalty of 5e-324 is 0 in float32, and
    -inf * 0 is NaN, which greedy argmax took for the largest: the banned token came out. The penalty is held at
    float32's smallest normal instead, so -inf stays -inf."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    logits[:, 7] = -5.0
    masked = [1, 2, 4]  # seen in the prompt, masked to -inf before the penalty
    logits[:, masked] = float("-inf")
    params = SamplingParams(temperature=temperature, repetition_penalty=5e-324, seed=1)
    out = Sampler(seed=2)(logits.clone(), [row(params, prompt=masked + [7])] * 2).token_ids
    assert all(t not in masked for t in out)
    got = logits.clone()
    apply_penalties(got, [row(params, prompt=masked + [7])] * 2)
    assert bool(torch.isneginf(got[:, masked]).all()) and not bool(got.isnan().any())
