"""gpu_worker.serve.step_log: a worker's step log holds its engine limits, then one line per step that ran a
forward (shape and seconds); calibrate's --from-steps fits a profile on it (services.bench.calibrate)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_worker.core.sched_output import SchedulerOutput
from gpu_worker.executor.cost_model import StepShape
from gpu_worker.serve.step_log import StepLog, read_step_log
from services.bench.calibrate import from_steps

pytestmark = pytest.mark.unit


def fake_engine():
    return SimpleNamespace(model_name="tiny", runner=SimpleNamespace(execute=lambda sched: "logits"),
                           scheduler=SimpleNamespace(config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=256),
                                                     kv_cache_manager=SimpleNamespace(block_size=16, num_blocks=99)))


def test_each_step_with_a_forward_is_logged_with_its_shape(tmp_path, monkeypatch):
    engine = fake_engine()
    log = StepLog(str(tmp_path / "steps.jsonl"), engine)
    shapes = [StepShape(32, 0, 32, 528), StepShape(0, 3, 90, 0)]
    monkeypatch.setattr(StepShape, "of", classmethod(lambda cls, sched: shapes.pop(0)))
    assert engine.runner.execute(SchedulerOutput()) == "logits"  # the forward still runs
    log.step(0.25)
    log.step(0.5)  # no forward in between: nothing written
    engine.runner.execute(SchedulerOutput())
    log.step(0.125)
    log.close()
    limits, steps = read_step_log(str(tmp_path / "steps.jsonl"))
    assert limits == {"model": "tiny", "block_size": 16, "num_kv_blocks": 99, "max_num_seqs": 8,
                      "max_num_batched_tokens": 256}
    assert steps == [(StepShape(32, 0, 32, 528), 0.25), (StepShape(0, 3, 90, 0), 0.125)]


def test_calibrate_fits_a_profile_on_a_step_log(tmp_path):
    path = tmp_path / "steps.jsonl"
    truth = (0.01, 2e-4, 1e-3, 1e-6, 1e-8)
    lines = ['{"engine": {"model": "/m/tiny", "block_size": 16, "num_kv_blocks": 99, "max_num_seqs": 8, '
             '"max_num_batched_tokens": 256}}']
    for p, n, ctx, cached in [(64, 0, 64, 0), (512, 0, 512, 0), (128, 2, 700, 512), (0, 1, 100, 0), (0, 8, 900, 0),
                              (0, 32, 5000, 0), (256, 4, 2000, 256), (1024, 0, 1024, 0), (0, 16, 3000, 0)]:
        pairs = p * cached + p * (p + 1) // 2
        t = truth[0] + truth[1] * p + truth[2] * n + truth[3] * ctx + truth[4] * pairs
        lines.append(f'{{"prefill_tokens": {p}, "decode_seqs": {n}, "context_tokens": {ctx}, '
                     f'"prefill_pairs": {pairs}, "seconds": {t}}}')
    path.write_text("\n".join(lines) + "\n")
    profile, fit, samples = from_steps(str(path), None)
    assert len(samples) == 9 and fit.r2 > 0.999
    assert profile.name == "tiny-steps" and profile.num_kv_blocks == 99 and profile.max_num_seqs == 8
    assert profile.a_s == pytest.approx(truth[0], rel=0.01)
    path.write_text('{"seconds": 1}\n')
    with pytest.raises(SystemExit, match="steps.jsonl"):
        from_steps(str(path), None)
