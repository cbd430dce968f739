"""The fuzz tier's fleet: a private Redis, one worker on the tiny random-weight Llama, one gateway with an API
key; one fleet for the package. Every test here ends by checking that no process of it has exited."""

from __future__ import annotations

import pytest
from fleet_harness import Fleet
from fuzz_fleet import assert_alive, revive, start_fleet


@pytest.fixture(scope="package")
def fuzz_fleet(tiny_llama_dir, tmp_path_factory):
    with Fleet(tiny_llama_dir, tmp_path_factory.mktemp("fuzz-fleet")) as fleet:
        yield start_fleet(fleet)


@pytest.fixture
def fleet(fuzz_fleet):
    """The package's fleet, whole before the test (a worker an earlier test killed is started again) and
    checked after it: a process that exited during the test fails it."""
    revive(fuzz_fleet)
    yield fuzz_fleet
    assert_alive(fuzz_fleet)
