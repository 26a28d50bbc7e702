"""A learner's admission or preemption policy plugged into the real engine: what it may do to what it is given,
and what a wrong answer costs.

The batch builder's answer is checked at the boundary (``test_small_contracts``); these are the other two
policy seams.  A policy is handed copies of the scheduler's queues (lists, as the labs' checkers give them), so
one that changes them (``waiting.pop(0)`` to "take the head", ``running.pop()``) cannot make a request vanish
or strand its KV blocks; and one that answers with something that is not a request of the queue it was offered
(``None``, request ids, a running request) gets a ``ValueError`` naming its policy and the bad item -- not a
``TypeError`` from the scheduler's loop, a ``list.remove`` error or an assertion in the KV manager.  Either way
the engine serves on, leak-free.
"""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.labs.workloads import sim_engine

from invariants import assert_no_leak, drain

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)


def _alone(prompt: list[int], request_id: str) -> list[int]:
    """The oracle: the tokens of ``prompt`` run by itself on a fresh engine with the default policies (the
    simulated executor's tokens depend on the request id and length, so the id is the same)."""
    engine = sim_engine(num_blocks=32, block_size=4)
    engine.add_request({"prompt_token_ids": prompt}, PARAMS, request_id)
    return drain(engine)[request_id].outputs[0].token_ids


class _TakesTheHead:
    """Admits one request a step, taking it off the queue it was handed (a learner's ``pop(0)``)."""

    def order(self, waiting, running):
        return [waiting.pop(0)] if waiting else []


class _TrimsTheQueue:
    """Keeps at most two waiting requests in view by popping the rest off the queue it was handed."""

    def order(self, waiting, running):
        while len(waiting) > 2:
            waiting.pop()
        return list(waiting)


class _PopsRunning:
    """Reads ``running`` destructively (``running.pop()``) before answering FCFS."""

    def order(self, waiting, running):
        while running:
            running.pop()
        return list(waiting)


@pytest.mark.parametrize("policy", [_TakesTheHead, _TrimsTheQueue, _PopsRunning])
def test_an_admission_policy_that_changes_the_queues_it_is_given_loses_no_request(policy):
    """Before: the policy was handed the scheduler's own deque and list, so a removed waiting request was never
    admitted and never finished (``has_unfinished_requests()`` said False, ``LLM.generate`` raised "aborted by
    another caller"), and a popped running request kept its KV blocks for ever.  Oracle: every request ends
    ``"length"`` with the tokens it gets run alone, the engine holds nothing afterwards, no block leaked."""
    engine = sim_engine(num_blocks=32, block_size=4, admission_policy=policy())
    prompts = {f"r{i}": [7 + i] * (5 + i) for i in range(4)}
    engine.add_request({"prompt_token_ids": prompts["r0"]}, PARAMS, "r0")
    engine.step()  # r0 runs: the policy is asked again with something in ``running``
    for rid in ("r1", "r2", "r3"):
        engine.add_request({"prompt_token_ids": prompts[rid]}, PARAMS, rid)
    finals = drain(engine, stalls_ok=True)
    assert {rid: out.outputs[0].finish_reason for rid, out in finals.items()} == dict.fromkeys(prompts, "length")
    for rid, prompt in prompts.items():
        assert finals[rid].outputs[0].token_ids == _alone(prompt, rid), rid
    assert engine.requests == {} and not engine.has_unfinished_requests()
    assert_no_leak(engine)


def _foreign_request():
    other = sim_engine()
    other.add_request({"prompt_token_ids": [5] * 4}, PARAMS, "elsewhere")
    return other.scheduler.waiting[0]


@pytest.mark.parametrize("answer, says", [
    (lambda waiting, running, foreign: None, "returned None"),
    (lambda waiting, running, foreign: 3, "returned 3"),
    (lambda waiting, running, foreign: [r.request_id for r in waiting], "returned 'b'"),
    (lambda waiting, running, foreign: list(running) + list(waiting), "request 'a' \\(running\\), which is not in the waiting"),
    (lambda waiting, running, foreign: [foreign, *waiting], "request 'elsewhere' \\(waiting\\), which is not in the waiting"),
])
def test_a_wrong_answer_from_an_admission_policy_is_a_value_error_naming_the_policy(answer, says):
    """The order is walked by the scheduler; before, these answers failed as ``'NoneType' object is not
    iterable``, ``'str' object has no attribute 'tenant'``, an ``AssertionError`` from the KV manager ("a request
    shares a prefix only before it holds blocks") or a ``ValueError`` carrying a whole Request's repr "is not in
    deque".  Now each is a ValueError naming the policy class and the bad item, raised before anything is
    allocated for it; with a correct policy back, both requests get their solo tokens and no block leaks."""
    foreign = _foreign_request()

    class Learners:
        wrong = True

        def order(self, waiting, running):
            return answer(waiting, running, foreign) if self.wrong else list(waiting)

    policy = Learners()
    engine = sim_engine(num_blocks=32, block_size=4, admission_policy=policy, enable_prefix_caching=True)
    policy.wrong = False
    engine.add_request({"prompt_token_ids": [7] * 10}, PARAMS, "a")
    engine.step()  # a runs
    engine.add_request({"prompt_token_ids": [8] * 10}, PARAMS, "b")
    policy.wrong = True
    with pytest.raises(ValueError, match=f"admission policy Learners.order {says}" if "request" not in says
                       else f"admission policy Learners.order returned {says}"):
        engine.step()
    assert foreign.block_ids == []  # nothing of this engine's pool was given to a request it does not hold
    policy.wrong = False
    finals = drain(engine)
    assert finals["a"].outputs[0].token_ids == _alone([7] * 10, "a")
    assert finals["b"].outputs[0].token_ids == _alone([8] * 10, "b")
    assert_no_leak(engine)


@pytest.mark.parametrize("answer, says", [
    (lambda running, foreign: None, "returned None"),
    (lambda running, foreign: running[-1].request_id, "returned 'r3'"),
    (lambda running, foreign: [running[-1]], "returned a list"),
    (lambda running, foreign: foreign, "returned request 'elsewhere'"),
])
def test_a_wrong_victim_from_a_preemption_policy_is_a_value_error_naming_the_policy(answer, says):
    """Before: ``list.remove(x): x not in list`` from inside the scheduler.  Now a ValueError names the policy
    and its answer; the engine, given a correct victim rule back, drains with every request at its full length
    and no block leaked."""
    foreign = _foreign_request()

    class Victims:
        wrong = True

        def choose_victim(self, running):
            return answer(running, foreign) if self.wrong else running[-1]

    policy = Victims()
    engine = sim_engine(num_blocks=12, block_size=4, preemption_policy=policy, max_num_seqs=4,
                        max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request({"prompt_token_ids": [7 + i] * 6}, params, f"r{i}")
    with pytest.raises(ValueError, match=f"preemption policy Victims.choose_victim {says}, which is not one of"):
        for _ in range(40):  # the pool (12 blocks) runs dry within a few decode steps
            engine.step()
    policy.wrong = False
    finals = drain(engine)
    assert all(len(out.outputs[0].token_ids) == 30 for out in finals.values()) and len(finals) == 4
    assert_no_leak(engine)


def test_a_preemption_policy_that_removes_its_victim_from_the_list_it_was_offered_still_works():
    """With ``preemption_protect_after=0`` the candidates were the scheduler's own ``running`` list, so a policy
    that did ``running.remove(victim)`` made the scheduler's own removal fail (``list.remove(x): x not in
    list``).  A policy's list is its own: the run ends like the default rule's (``running[-1]``)."""
    class Removes:
        def choose_victim(self, running):
            victim = running[-1]
            running.remove(victim)
            return victim

    def run(policy):
        engine = sim_engine(num_blocks=12, block_size=4, preemption_policy=policy, max_num_seqs=4,
                            max_num_batched_tokens=64, preemption_protect_after=0)
        for i in range(4):
            engine.add_request({"prompt_token_ids": [7 + i] * 6}, SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
        finals = drain(engine)
        assert_no_leak(engine)
        return {rid: out.outputs[0].token_ids for rid, out in finals.items()}, engine.stats()["num_preemptions"]

    from minivllm.sched.policies import RecomputeLatestPreemption

    assert run(Removes()) == run(RecomputeLatestPreemption())
