"""`kvfleet bench throughput`'s flag errors: found before any model is loaded, each naming its flag."""

import argparse

import pytest

from services.bench import command

pytestmark = pytest.mark.unit


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(["throughput", *argv])


@pytest.mark.parametrize(("argv", "message"), [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--rounds", "3", "--no-vllm"], "--rounds N > 1 alternates kvfleet with vLLM, and vLLM is off (--no-vllm)"),
    (["--rounds", "3", "--vllm-venv", "/nonexistent/venv"], "not installed (--vllm-venv)"),
    (["--top-p", "0"], "--top-p must be in"),
])
def test_a_bad_flag_fails_before_anything_runs_and_names_the_flag(argv, message, capsys, monkeypatch):
    def no_model(*_a, **_k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("gpu_worker.executor.model_loader.load_model_files", no_model)
    assert command.throughput(_args(*argv)) == 2
    assert message in capsys.readouterr().err
