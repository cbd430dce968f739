"""Scheduling policies: each built-in's admission order and preemption victim on hand-made requests, a user's
policy loaded by name (tests/custom_policy.py) through the real Scheduler, and the errors for bad names."""

import sys

import pytest

from gpu_worker.core.config import CacheConfig, SchedulerConfig
from gpu_worker.core.policies import (
    FCFS,
    Priority,
    SchedulingPolicy,
    ShortestJobFirst,
    make_policy,
    policy_class,
)
from gpu_worker.core.request import Request, RequestStatus
from gpu_worker.core.scheduler import Scheduler
from services.cli import build_parser
from shared.sampling_params import SamplingParams
from tests.custom_policy import LongestPromptFirst

pytestmark = pytest.mark.unit

USER_POLICY = "tests.custom_policy:LongestPromptFirst"


def req(rid, num_prompt, *, arrival=0.0, priority=0, outputs=(), max_tokens=1, first=0):
    return Request(rid, list(range(first, first + num_prompt)), SamplingParams(max_tokens=max_tokens), priority=priority,
                   arrival_time=arrival, output_token_ids=list(outputs))


def ids(requests):
    return [r.request_id for r in requests]


def admission_order(policy, waiting, now=0.0):
    """The order `policy` admits `waiting` in when each choice leaves the queue (as the scheduler does)."""
    waiting, order = list(waiting), []
    while waiting:
        chosen = policy.next_to_admit(waiting, now)
        waiting.remove(chosen)
        order.append(chosen.request_id)
    return order


def test_fcfs_admits_in_queue_order_not_by_arrival():
    # a preempted request is back at the front of the queue although it arrived later
    waiting = [req("preempted", 4, arrival=5.0), req("a", 4, arrival=1.0), req("b", 2, arrival=2.0, priority=-1)]
    assert admission_order(FCFS(), waiting) == ["preempted", "a", "b"]


def test_priority_lower_value_first_then_earlier_arrival():
    waiting = [req("late-low", 3, arrival=1, priority=5), req("late-high", 3, arrival=2, priority=0),
               req("early-high", 3, arrival=0, priority=0), req("urgent", 9, arrival=3, priority=-2)]
    assert admission_order(Priority(), waiting) == ["urgent", "early-high", "late-high", "late-low"]


def test_sjf_counts_output_tokens_and_ages_by_block_size_per_aging_s():
    # no waiting time: fewest tokens (prompt + output so far) first, arrival breaks ties
    waiting = [req("resumed", 4, outputs=[1] * 8, arrival=0), req("long", 10, arrival=2),
               req("short-late", 6, arrival=3), req("short-early", 6, arrival=1)]
    assert admission_order(ShortestJobFirst(block_size=4, aging_s=0), waiting, now=3) == [
        "short-early", "short-late", "long", "resumed"]
    # aging: 4 tokens shorter per 10 s waited; at now=20 "old" counts 40 - 8 = 32 tokens, "fresh" 34
    aged = [req("fresh", 34, arrival=20.0), req("old", 40, arrival=0.0)]
    assert admission_order(ShortestJobFirst(block_size=4, aging_s=10.0), aged, now=20.0) == ["old", "fresh"]
    assert admission_order(ShortestJobFirst(block_size=4, aging_s=0), aged, now=20.0) == ["fresh", "old"]


@pytest.mark.parametrize("policy", [FCFS(), Priority(), ShortestJobFirst(block_size=4, aging_s=10.0)])
def test_built_in_victim_is_lowest_priority_then_latest_arrival_then_latest_admitted(policy):
    running = [req("low-early", 4, arrival=0, priority=9), req("high-late", 4, arrival=5, priority=0),
               req("low-late-1", 4, arrival=3, priority=9), req("low-late-2", 4, arrival=3, priority=9)]
    assert policy.next_to_preempt(running, 10.0).request_id == "low-late-2"
    assert policy.next_to_preempt(running[:3], 10.0).request_id == "low-late-1"
    assert policy.next_to_preempt(running[:2], 10.0).request_id == "low-early"
    assert policy.next_to_preempt(running[1:2], 10.0).request_id == "high-late"


def test_make_policy_builds_built_ins_and_passes_objects_through():
    assert type(make_policy("fcfs", block_size=4, sjf_aging_s=10.0)) is FCFS
    assert type(make_policy("priority", block_size=4, sjf_aging_s=10.0)) is Priority
    sjf = make_policy("sjf", block_size=16, sjf_aging_s=8.0)
    assert type(sjf) is ShortestJobFirst and sjf.credit_per_s == 2.0
    own = LongestPromptFirst()
    assert make_policy(own, block_size=4, sjf_aging_s=10.0) is own
    assert type(make_policy(USER_POLICY, block_size=4, sjf_aging_s=10.0)) is LongestPromptFirst


def scheduler(policy, *, num_blocks=32, max_num_seqs=8):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=32,
                                     policy=policy),
                     CacheConfig(block_size=4, num_blocks=num_blocks), clock=lambda: 0.0)


def step(s):
    out = s.schedule()
    s.update_from_output(out, {q.request_id: 7 for q in out.seqs if q.sample})
    return out


def test_user_policy_loaded_by_name_changes_the_admission_order():
    def run(policy):
        s = scheduler(policy, max_num_seqs=1)
        for rid, n in [("three", 3), ("nine", 9), ("five", 5)]:
            s.add_request(req(rid, n))
        return [step(s).seqs[0].request_id for _ in range(3)]

    assert type(scheduler(USER_POLICY).policy) is LongestPromptFirst
    assert run("fcfs") == ["three", "nine", "five"]
    assert run(USER_POLICY) == ["nine", "five", "three"]


def test_user_policy_chooses_the_preemption_victim():
    """4 blocks of 4 slots. "a" (7-token prompt, arrived last) and "b" (5 tokens, arrived first) fill them;
    after two steps "a" needs a third block. The built-in rule preempts the latest arrival ("a" itself);
    LongestPromptFirst preempts the one with the least KV computed ("b": 6 tokens against 8)."""
    def run(policy):
        s = scheduler(policy, num_blocks=4)
        s.add_request(req("b", 5, arrival=0.0, max_tokens=8, first=100))
        s.add_request(req("a", 7, arrival=1.0, max_tokens=8))
        step(s)
        step(s)
        out = step(s)
        preempted = [r.request_id for r in s.waiting if r.status == RequestStatus.PREEMPTED]
        return preempted, [(q.request_id, q.block_table) for q in out.seqs]

    assert run("fcfs") == (["a"], [("b", [0, 1])])
    assert run(USER_POLICY) == (["b"], [("a", [0, 1, 3])])


@pytest.mark.parametrize("policy, admitted", [("priority", ["high", "middle"]), ("fcfs", ["high"])])
def test_preempted_request_comes_back_with_its_priority(policy, admitted):
    """"low" is preempted for "high" and waits at the front of the queue. Under "priority" it keeps its
    priority 9, so "middle" (priority 5, arrived later, fits the one free block) goes first; under "fcfs" the
    front of the queue waits for its 3 blocks and nothing passes it."""
    s = scheduler(policy, num_blocks=4)
    s.add_request(req("low", 6, arrival=0.0, priority=9, max_tokens=8))
    s.add_request(req("high", 6, arrival=1.0, priority=0, max_tokens=8, first=100))
    for _ in range(4):
        step(s)
    low = s.get_request("low")
    assert (low.status, low.priority, low.arrival_time) == (RequestStatus.PREEMPTED, 9, 0.0)
    s.add_request(req("middle", 2, arrival=2.0, priority=5, max_tokens=1, first=200))
    assert [q.request_id for q in step(s).seqs] == admitted
    assert low.status == RequestStatus.PREEMPTED
    while s.get_request("high"):
        step(s)
    assert [q.request_id for q in step(s).seqs][0] == "low"


def test_policy_must_choose_from_what_it_is_given():
    class Stray(SchedulingPolicy):
        def next_to_admit(self, waiting, now):
            return req("stranger", 2)

    s = scheduler(Stray())
    s.add_request(req("a", 2))
    with pytest.raises(RuntimeError, match="Stray.next_to_admit returned 'stranger', which is not waiting"):
        s.schedule()


@pytest.mark.parametrize("spec, message", [
    ("fifo", r"'fifo' is neither a built-in policy \(fcfs, priority, sjf\) nor package.module:Class"),
    ("tests.custom_policy:", "neither a built-in policy"),
    ("tests.no_such_module:Policy", "no module named 'tests.no_such_module' .*PYTHONPATH"),
    ("no_such_package.policies:Policy", "no module named 'no_such_package.policies'"),
    ("tests.custom_policy:Nope", "module 'tests.custom_policy' has no attribute 'Nope'"),
    ("collections:OrderedDict", "collections.OrderedDict is not a policy: it must be a subclass of "
                                "gpu_worker.core.policies.SchedulingPolicy"),
    ("os.path:join", "os.path.join is not a policy"),
])
def test_bad_names_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        policy_class(spec)
    with pytest.raises(ValueError, match=r"^scheduling_policy \(--scheduling-policy\) .*" + message):
        SchedulerConfig(policy=spec)


def test_a_missing_import_inside_the_users_module_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "broken_policy_module.py").write_text("import no_such_dependency_of_the_policy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_of_the_policy"):
        policy_class("broken_policy_module:Policy")
    sys.modules.pop("broken_policy_module", None)


def test_config_refuses_a_class_where_an_object_or_name_belongs():
    with pytest.raises(ValueError, match="a SchedulingPolicy object, got <class"):
        SchedulerConfig(policy=LongestPromptFirst)


def test_worker_flag_takes_a_user_class_and_names_itself_in_errors(capsys):
    parser = build_parser()
    args = parser.parse_args(["worker", "--scheduling-policy", USER_POLICY])
    assert args.scheduling_policy == USER_POLICY
    assert parser.parse_args(["worker"]).scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--scheduling-policy", "tests.custom_policy:Nope"])
    assert "argument --scheduling-policy: 'tests.custom_policy:Nope': module 'tests.custom_policy' has no " \
           "attribute 'Nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--help"])
    assert "package.module:Class" in " ".join(capsys.readouterr().out.split())
