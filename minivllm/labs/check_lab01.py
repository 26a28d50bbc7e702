"""Checkers for lab 1 (the serving loop): step composition and static batching."""

from __future__ import annotations

from minivllm.labs.checkers import Case, CheckResult, run_checks
from minivllm.labs.workloads import random_requests, run_engine, sim_engine


def check_split_step(fn) -> CheckResult:
    """Check ``fn(seqs, prompt_lens) -> (prefill_tokens, decode_tokens)``.

    ``seqs`` is a step-log entry's ``[(request_id, start, num_tokens), ...]``.
    """
    def engine_case(f):
        eng = sim_engine(block_size=4, max_num_batched_tokens=24)
        reqs = random_requests(4, seed=2, prompt_range=(5, 30), output_range=(3, 6))
        run_engine(eng, reqs)
        lens = {f"r{i}": len(p) for i, (p, _) in enumerate(reqs)}
        got = [f(e["seqs"], lens) for e in eng.step_log]
        ok = all(p + d == e["num_tokens"] for (p, d), e in zip(got, eng.step_log))
        return ok and sum(d for _, d in got) == sum(m for _, m in reqs) - len(reqs)

    cases = [
        Case("an empty step", lambda f: f([], {}), (0, 0), "no sequences: no tokens of either kind"),
        Case("one whole prompt", lambda f: f([("a", 0, 7)], {"a": 7}), (7, 0),
             "a sequence starting before the prompt's end is prefill"),
        Case("one decode token", lambda f: f([("a", 7, 1)], {"a": 7}), (0, 1),
             "position 7 of a 7-token prompt is the first OUTPUT token: start >= prompt_len means decode"),
        Case("a 1-token prefill chunk is still prefill", lambda f: f([("a", 6, 1)], {"a": 7}), (1, 0),
             "don't classify by num_tokens == 1: the last prompt token of a chunked prefill is one token too"),
        Case("count tokens, not sequences", lambda f: f([("a", 0, 5), ("b", 3, 1), ("c", 0, 9)], {"a": 12, "b": 3, "c": 20}),
             (14, 1), "add num_tokens for prefill chunks; each decode contributes exactly its 1 token"),
        Case("a whole engine run adds up", engine_case, True,
             "prefill + decode must equal the step's num_tokens, and decode steps = outputs - 1 per request"),
    ]
    return run_checks("split_step", fn, cases)


def _policy_run(policy, max_steps=400):
    eng = sim_engine(max_num_seqs=2, max_num_batched_tokens=256, admission_policy=policy)
    finals = run_engine(eng, random_requests(5, seed=4, prompt_range=(8, 40), output_range=(3, 12)), max_steps=max_steps)
    admitted_at = {}
    for e in eng.step_log:
        for rid, _, _ in e["seqs"]:
            admitted_at.setdefault(rid, e["step"])
    return len(finals), [admitted_at.get(f"r{i}") for i in range(5)]


def check_static_batching(cls) -> CheckResult:
    """Check an AdmissionPolicy class that admits a new batch only when the engine is empty."""
    class R:  # a stand-in request: the policy only needs to pass them through
        def __init__(self, name):
            self.request_id = name

        def __repr__(self):
            return self.request_id

    a, b, c = R("a"), R("b"), R("c")
    expected_run = (5, [0, 0, 11, 11, 20])

    def run(k):
        return _policy_run(k())

    cases = [
        Case("engine empty: everybody may try, in queue order", lambda k: k().order([a, b, c], []), [a, b, c],
             "when nothing runs, return the waiting list as it is (the engine stops at max_num_seqs)"),
        Case("nothing waiting", lambda k: k().order([], []), [], "an empty queue gives an empty order"),
        Case("a batch is running: nobody joins", lambda k: k().order([b, c], [a]), [],
             "static batching: while any request runs, return [] so no one is admitted"),
        Case("the real engine runs static batches of max_num_seqs=2", run, expected_run,
             "requests should start only in steps where the previous batch has fully drained",
             show_expected=f"all 5 finish; first scheduled in steps {expected_run[1]}"),
    ]
    return run_checks("static batching", cls, cases)
