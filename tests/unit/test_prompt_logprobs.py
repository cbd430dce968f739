"""Prompt logprobs from hidden states: each target's logprob and the top N equal a log-softmax of the whole
logits, across the slices the rows are scored in."""

import pytest
import torch

from gpu_worker.executor import prompt_logprobs
from gpu_worker.executor.prompt_logprobs import score_rows

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("top_n", [0, 1, 5])
def test_rows_match_a_full_log_softmax_across_slices(monkeypatch, top_n):
    monkeypatch.setattr(prompt_logprobs, "SLICE_ROWS", 7)  # 20 rows: slices of 7, 7, 6
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=gen)  # [V, H]
    hidden = torch.randn(20, 16, generator=gen)
    targets = torch.randint(0, 50, (20,), generator=gen).tolist()
    calls = []

    def compute_logits(h):
        calls.append(len(h))
        return h @ weight.T

    entries, ranks = score_rows(compute_logits, hidden, targets, top_n)
    assert calls == [7, 7, 6]
    full = (hidden @ weight.T).log_softmax(-1)
    for i, entry in enumerate(entries):
        assert entry[targets[i]] == pytest.approx(full[i, targets[i]].item(), abs=1e-5)
        assert ranks[i] == full[i].argsort(descending=True).tolist().index(targets[i]) + 1
        vals, ids = full[i].topk(top_n) if top_n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert set(entry) == {targets[i], *ids.tolist()}
        for t, v in zip(ids.tolist(), vals.tolist(), strict=True):
            assert entry[t] == pytest.approx(v, abs=1e-5)
        assert next(iter(entry)) == targets[i]  # the target first, as the sampler's entries have the chosen token


def test_no_rows():
    assert score_rows(lambda h: h, torch.empty(0, 4), [], 3) == ([], [])
