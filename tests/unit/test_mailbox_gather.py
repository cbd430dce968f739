"""gateway.inbox.gather: the chunks that piled up behind one in a request's mailbox go out merged (one event),
but only while they continue it: the same choice, the next sequence number, the same owner, no error."""

import pytest

from gateway.inbox import Mailbox, gather
from shared.messages import ChunkError, OutputChunk, Usage

pytestmark = pytest.mark.unit


def c(seq: int, text: str, **kw) -> OutputChunk:
    return OutputChunk(request_id="r", seq=seq, token_ids=[100 + seq], text=text, **kw)


def box_of(*chunks: OutputChunk) -> tuple[Mailbox, OutputChunk]:
    box = Mailbox()
    box.items.extend(chunks)
    first = box.items.popleft()
    assert box.dedup.accept_next(first)
    return box, first


def test_what_piled_up_goes_out_as_one_chunk_up_to_the_final_one():
    usage = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    box, first = box_of(c(0, "a"), c(1, "b"), c(2, "c"), c(3, "d", finish_reason="stop", final=True, usage=usage))
    merged = gather(first, box)
    assert (merged.seq, merged.token_ids, merged.text) == (3, [100, 101, 102, 103], "abcd")
    assert merged.final and merged.finish_reason == "stop" and merged.usage == usage
    assert not box.items and box.dedup.last_seq == 3


def test_a_relay_that_keeps_up_sends_each_chunk_as_it_is():
    box, first = box_of(c(0, "a"))
    assert gather(first, box) is first


@pytest.mark.parametrize("behind", [
    c(3, "x"),  # a gap (2 is missing): the usual path raises OutputLost there
    c(1, "x", index=1),  # another choice
    c(1, "", error=ChunkError(kind="worker_lost", message="gone")),
    c(1, "x", attempt=1),  # another owner
    c(1, "x", logprobs=[{101: -0.5}]),  # logprobs where the first has none
])
def test_it_stops_at_a_chunk_that_does_not_continue_the_first(behind):
    box, first = box_of(c(0, "a"), c(1, "b"), behind) if behind.seq == 3 else box_of(c(0, "a"), behind)
    merged = gather(first, box)
    assert box.items[0] is behind  # left for the usual path
    assert merged.text == ("ab" if behind.seq == 3 else "a")


def test_logprobs_are_kept_in_order():
    box, first = box_of(c(0, "a", logprobs=[{100: -0.1}]), c(1, "b", logprobs=[{101: -0.2}]))
    assert gather(first, box).logprobs == [{100: -0.1}, {101: -0.2}]


def test_nothing_is_merged_into_a_finished_choice():
    box, first = box_of(c(0, "a", finish_reason="length"), c(1, "b"))
    assert gather(first, box) is first and len(box.items) == 1
