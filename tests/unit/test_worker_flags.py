"""`kvfleet worker` flags that cannot go together are refused before anything loads, naming both."""

from __future__ import annotations

import pytest

from gpu_worker.serve.worker_cmd import _engine
from services.cli import build_parser

pytestmark = pytest.mark.unit


def worker_args(*flags: str):
    return build_parser().parse_args(["worker", "--model", "smollm2", *flags])


def test_async_output_is_off_unless_asked():
    assert worker_args().async_output is False and worker_args("--async-output").async_output is True


@pytest.mark.parametrize("flags, named", [
    (["--async-output", "--step-log", "steps.jsonl"], "--step-log"),
    (["--async-output", "--simulate", "smollm2-cpu"], "--async-output: a simulated worker"),
])
def test_async_output_refuses_what_it_cannot_serve(flags, named):
    with pytest.raises(ValueError, match=named):
        _engine(worker_args(*flags), "smollm2")
