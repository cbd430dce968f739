"""gpu_worker.engine.isolation with a stand-in forward: bisection finds every culprit, runs each good sequence
successfully once and keeps batch order; a fault shared by all is the engine's; the sampler's fallback."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.core.sched_output import ScheduledSeq, SchedulerOutput
from gpu_worker.engine import isolation
from gpu_worker.engine.sampler import Sampler, SamplingRow
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

V = 8


def seq(i: int, sample: bool = True) -> ScheduledSeq:
    return ScheduledSeq(request_id=f"r{i}", token_ids=[i], start_pos=0, block_table=[i], slot_mapping=[i * 16],
                        sample=sample)


class Forward:
    """Fails while any poison request is in the batch; each sampling row's logits say which seq it is."""

    def __init__(self, poison: set[str]):
        self.poison, self.batches, self.ran = poison, [], []

    def __call__(self, sched: SchedulerOutput) -> torch.Tensor:
        ids = [s.request_id for s in sched.seqs]
        self.batches.append(ids)
        if self.poison & set(ids):
            raise RuntimeError(f"bad batch {ids}")
        self.ran += ids
        return torch.tensor([[float(s.token_ids[0])] * V for s in sched.seqs if s.sample])


def test_the_fast_path_is_one_forward():
    fwd = Forward(set())
    sched = SchedulerOutput(seqs=[seq(i) for i in range(4)])
    logits, culprits = isolation.execute(fwd, sched)
    assert culprits == {} and len(fwd.batches) == 1 and logits[:, 0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("poison", [{"r7"}, {"r0"}, {"r3"}, {"r2", "r5"}, {"r0", "r1", "r6"}])
def test_bisection_finds_every_culprit_and_keeps_the_rest(poison):
    fwd = Forward(poison)
    seqs = [seq(i, sample=i != 4) for i in range(8)]  # r4 is a prefill chunk: nothing to sample
    logits, culprits = isolation.execute(fwd, SchedulerOutput(seqs=seqs, blocks_to_copy=[(90, 1), (91, 6)]))
    assert set(culprits) == poison and all("RuntimeError: bad batch" in m for m in culprits.values())
    good = [s.request_id for s in seqs if s.request_id not in poison]
    assert sorted(fwd.ran) == sorted(good), "each good sequence ran successfully exactly once"
    assert logits[:, 0].tolist() == [float(s.token_ids[0]) for s in seqs if s.sample and s.request_id not in poison]
    assert fwd.batches[1] == [f"r{i}" for i in range(4)], "the first retry drops the newest half"
    assert all([c] in fwd.batches for c in poison), "a culprit is blamed only after it failed alone"
    assert len(fwd.batches) <= 1 + 2 * len(poison) * 3, "about k*log2(n) retries, not one per sequence"


def test_block_copies_go_with_the_sequences_that_own_their_destination():
    seen = []

    def fwd(sched):
        seen.append((sorted(s.request_id for s in sched.seqs), sched.blocks_to_copy))
        if any(s.request_id == "r1" for s in sched.seqs):
            raise RuntimeError("poison")
        return torch.zeros(sum(s.sample for s in sched.seqs), V)

    isolation.execute(fwd, SchedulerOutput(seqs=[seq(0), seq(1)], blocks_to_copy=[(90, 0), (91, 1)]))
    assert seen[1:] == [(["r0"], [(90, 0)]), (["r1"], [(91, 1)])]


def test_a_fault_shared_by_every_request_is_the_engines():
    fwd = Forward({f"r{i}" for i in range(3)})
    with pytest.raises(isolation.EngineFault, match="every request of the step failed"):
        isolation.execute(fwd, SchedulerOutput(seqs=[seq(i) for i in range(3)]))


def test_a_lone_request_that_fails_is_the_culprit():
    logits, culprits = isolation.execute(Forward({"r0"}), SchedulerOutput(seqs=[seq(0)]))
    assert logits is None and list(culprits) == ["r0"]


def test_the_sampler_falls_back_to_row_by_row_and_fails_only_the_bad_row():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0), [], [], [], None) for _ in range(3)]
    bad = SamplingParams(temperature=0.5)
    bad.top_k = 2**63  # past validation: torch.tensor([top_k]) overflows
    rows[1] = SamplingRow(bad, [], [], [], None)
    out, failed = isolation.sample(Sampler(), logits.clone(), rows)
    assert list(failed) == [1] and "Overflow" in failed[1]
    assert [out.token_ids[0], out.token_ids[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]
