"""The outbox's merging of queued batches (gpu_worker.serve.outbox): chunks a request's old delivery left queued
are dropped when a new delivery of the same request joins the batch. Written under the new delivery's owner
token, they went out with the fast flush and the resumed run wrote the same sequence numbers again."""

from __future__ import annotations

import pytest

from gpu_worker.serve.outbox import Outbox, _Batch
from shared.messages import OutputChunk
from shared.streams import Ack

pytestmark = pytest.mark.unit


def chunks(rid: str, seqs: range) -> list[OutputChunk]:
    return [OutputChunk(request_id=rid, seq=s, token_ids=[s]) for s in seqs]


def test_a_new_delivery_drops_what_the_old_one_left_queued():
    old, new, other = Ack("req:w0", "1-0", 1), Ack("req:w0", "1-0", 3), Ack("req:w0", "2-0", 1)
    batch = _Batch(chunks=chunks("stale", range(84, 87)) + chunks("fine", range(5, 7)),
                   owners={"stale": old, "fine": other})
    Outbox._merge(batch, _Batch(chunks=chunks("stale", range(84, 86)), owners={"stale": new}))
    assert [(c.request_id, c.seq) for c in batch.chunks] == [("fine", 5), ("fine", 6), ("stale", 84), ("stale", 85)]
    assert batch.owners == {"stale": new, "fine": other}


def test_the_same_delivery_keeps_everything_in_order():
    owner = Ack("req:w0", "1-0", 1)
    batch = _Batch(chunks=chunks("r", range(0, 3)), owners={"r": owner})
    Outbox._merge(batch, _Batch(chunks=chunks("r", range(3, 5)), owners={"r": owner}))
    assert [c.seq for c in batch.chunks] == [0, 1, 2, 3, 4]
