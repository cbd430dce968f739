"""shared.fleet_state.parse_status: a worker's status as this version reads it, or UnreadableStatus naming the
first field that is wrong, said in the log once per worker and reason however often the fleet is read."""

from __future__ import annotations

import json

import pytest

from shared.fleet_state import UnreadableStatus, parse_status
from shared.messages import WorkerStatus

pytestmark = pytest.mark.unit


def test_a_status_this_version_wrote_is_read_and_extra_fields_of_a_newer_one_are_ignored():
    status = WorkerStatus(worker_id="w0", model="m", max_model_len=256, block_size=16, total_blocks=64,
                          free_blocks=40)
    assert parse_status("w0", status.model_dump_json()) == status
    newer = json.loads(status.model_dump_json()) | {"kv_tiers": {"cpu": 128}}
    assert parse_status("w0", json.dumps(newer)) == status


@pytest.mark.parametrize(("raw", "reason"), [
    ('{"worker_id": "w9", "model": "m"}', "max_model_len: Field required (and 3 more)"),
    ('{"worker_id": "w9", "model": "m", "max_model_len": 256, "block_size": 16, "total_blocks": "many", '
     '"free_blocks": 1}', "total_blocks: Input should be a valid integer, unable to parse string as an integer"),
    ("not json", "the value: Invalid JSON: expected ident at line 1 column 2"),
])
def test_an_unreadable_status_names_what_is_wrong_and_is_said_once(raw, reason, caplog):
    with caplog.at_level("WARNING", logger="kvfleet.fleet"):
        for _ in range(3):  # the fleet is read on every request
            with pytest.raises(UnreadableStatus) as e:
                parse_status("w9", raw)
            assert str(e.value) == reason
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"the status of worker w9 cannot be read ({reason})" in said[0], said
