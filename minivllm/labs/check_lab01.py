"""Checkers for lab 1 (the serving loop): step composition and static batching.

The module ends with the lab's registration (:data:`LAB`): exercises, points, planted bugs,
hidden cases and quiz bank, all in one place (see :mod:`minivllm.labs.registry`).
"""

from __future__ import annotations

import random

from minivllm.labs.checkers import Case, CheckResult, run_checks
from minivllm.labs.registry import Exercise, Lab
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

    def recompute_case(budget):
        """A pool too small for four requests: the engine preempts (recompute) and later runs a victim's prompt
        AND its generated tokens again from position 0 -- in one chunk under a big budget (it starts in the
        prompt and ends past it), in several under a budget of 16 (a chunk of many tokens starts past the
        prompt).  Oracle: the timeline's own split."""
        from minivllm.labs.widgets import step_composition

        def case(f):
            eng = sim_engine(block_size=4, max_num_batched_tokens=budget, num_blocks=12 if budget > 16 else 16)
            reqs = random_requests(4, seed=2, prompt_range=(5, 30), output_range=(20, 40))
            run_engine(eng, reqs)
            lens = {f"r{i}": len(p) for i, (p, _) in enumerate(reqs)}
            for e in eng.step_log:
                got, want = f(list(e["seqs"]), dict(lens)), step_composition(e["seqs"], lens)
                if got != want:
                    return f"step {e['step']}: seqs {e['seqs']} with prompt_lens {lens} gave {got}, not {want}"
            return "every step matches"
        return case

    cases = [
        Case("an empty step", lambda f: f([], {}), (0, 0), "no sequences: no tokens of either kind"),
        Case("one whole prompt", lambda f: f([("a", 0, 7)], {"a": 7}), (7, 0),
             "a sequence starting before the prompt's end is prefill"),
        Case("one decode token", lambda f: f([("a", 7, 1)], {"a": 7}), (0, 1),
             "position 7 of a 7-token prompt is the first OUTPUT token: start >= prompt_len means decode"),
        Case("a 1-token prefill chunk is still prefill", lambda f: f([("a", 6, 1)], {"a": 7}), (1, 0),
             "don't classify by num_tokens == 1 alone: the last prompt token of a chunked prefill is one token too"),
        Case("count tokens, not sequences", lambda f: f([("a", 0, 5), ("b", 3, 1), ("c", 0, 9)], {"a": 12, "b": 3, "c": 20}),
             (14, 1), "add num_tokens for prefill chunks; each decode contributes exactly its 1 token"),
        Case("a whole engine run adds up", engine_case, True,
             "prefill + decode must equal the step's num_tokens, and decode steps = outputs - 1 per request"),
        Case("a preempted request's recompute is prefill", recompute_case(256), "every step matches",
             "after a recompute preemption a request runs its prompt and its generated tokens again, from position "
             "0, in one sequence: it starts inside the prompt, so all of it is prefill -- decide by where a "
             "sequence starts, not by where it ends, and don't split one sequence between the two kinds"),
        Case("a recompute chunk past the prompt is prefill", recompute_case(16), "every step matches",
             "under a small budget the recompute comes in chunks, and a later chunk starts past the prompt: a decode "
             "computes exactly one token, so a sequence of several tokens is prefill wherever it starts"),
    ]
    return run_checks("split_step", fn, cases)


def _policy_run(policy, max_steps=400):
    """``(requests finished, step each request first ran in)`` under ``policy``: two seats and a budget that fits
    any two prompts, so only the policy delays a start, and the first steps show static batches draining."""
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
        Case("the queue's order is kept, whatever the ids", lambda k: k().order([c, a, b], []), [c, a, b],
             "return the waiting list in the order it came: the engine's queue (arrivals, a preempted request put "
             "back at the front) is not sorted by request id, and admission order is the queue's"),
        Case("nothing waiting", lambda k: k().order([], []), [], "an empty queue gives an empty order"),
        Case("a batch is running: nobody joins", lambda k: k().order([b, c], [a]), [],
             "static batching: while any request runs, return [] so no one is admitted"),
        Case("the real engine runs static batches of max_num_seqs=2", run, expected_run,
             "requests should start only in steps where the previous batch has fully drained",
             show_expected=f"all 5 finish; first scheduled in steps {expected_run[1]}"),
    ]
    return run_checks("static batching", cls, cases)


# -- hidden cases (the grader's, seeded at grading time) ---------------------------------


def hidden_split_step(fn, seed: int) -> CheckResult:
    """Random step entries and a randomly configured engine run, compared with the timeline's own split
    (:func:`minivllm.labs.widgets.step_composition`, which colours every step the labs draw)."""
    from minivllm.labs.widgets import step_composition

    rng = random.Random(seed)

    def random_entries(f):
        for k in range(200):
            seqs, lens = [], {}
            for i in range(rng.randint(0, 6)):
                rid, p = f"s{i}", rng.randint(1, 64)
                lens[rid] = p
                if rng.random() < 0.5:
                    start = rng.randint(0, p - 1)
                    seqs.append((rid, start, rng.randint(1, p - start)))
                else:  # past the prompt: a decode, or now and then a chunk of a recompute
                    seqs.append((rid, rng.randint(p, p + 40), 1 if rng.random() < 0.8 else rng.randint(2, 24)))
            if f(list(seqs), dict(lens)) != step_composition(seqs, lens):
                return f"entry {k} differs"
        return "all 200 match"

    def engine_run(f):
        eng = sim_engine(block_size=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.randint(8, 48))
        reqs = random_requests(rng.randint(3, 7), seed=seed, prompt_range=(2, 60), output_range=(1, 8))
        run_engine(eng, reqs)
        lens = {f"r{i}": len(p) for i, (p, _) in enumerate(reqs)}
        return all(f(e["seqs"], lens) == step_composition(e["seqs"], lens) for e in eng.step_log)

    return run_checks("split_step (hidden)", fn, [
        Case("200 random step entries", random_entries, "all 200 match"),
        Case("a randomly configured engine run", engine_run, True),
    ], verbose=False)


def hidden_static_batching(cls, seed: int) -> CheckResult:
    """Random queues (ids in shuffled order: a queue is not sorted by id), and a random workload run against the
    engine on the figures' own static policy."""
    from minivllm.labs.workloads import StaticBatchAdmission

    rng = random.Random(seed)

    class R:
        def __init__(self, name):
            self.request_id = name

    def random_queues(k):
        ref = StaticBatchAdmission()
        for _ in range(100):
            waiting = [R(f"w{i}") for i in rng.sample(range(6), rng.randint(0, 6))]
            running = [R(f"r{i}") for i in range(rng.choice([0, 0, 1, rng.randint(1, 5)]))]
            if k().order(list(waiting), list(running)) != ref.order(waiting, running):
                return "differs"
        return "all 100 match"

    def engine_run(k):
        n, seqs = rng.randint(3, 8), rng.randint(1, 3)
        reqs = random_requests(n, seed=seed, prompt_range=(4, 40), output_range=(2, 10))

        def log(policy):
            eng = sim_engine(max_num_seqs=seqs, max_num_batched_tokens=256, admission_policy=policy)
            finals = run_engine(eng, reqs, max_steps=1000)
            return len(finals), [e["seqs"] for e in eng.step_log]

        return log(k()) == log(StaticBatchAdmission())

    return run_checks("static batching (hidden)", cls, [
        Case("100 random queues", random_queues, "all 100 match"),
        Case("a random workload, step for step", engine_run, True),
    ], verbose=False)


# -- quiz answers (``"compute": "minivllm.labs.check_lab01:<name>"`` in quizzes/lab01.json) ----


def quiz_decode_tokens_per_request() -> int:
    """Decode steps of a request with max_tokens=8: the first token comes from the prefill step."""
    eng = sim_engine(block_size=4)
    run_engine(eng, [([11] * 20, 8)])
    return sum(1 for e in eng.step_log for rid, start, n in e["seqs"] if start >= 20)


def quiz_prefill_steps_chunked() -> int:
    """Steps a 100-token prompt needs with a 32-token budget (chunked prefill)."""
    eng = sim_engine(block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    run_engine(eng, [([11] * 100, 1)])
    return len(eng.step_log)


# -- the registration ---------------------------------------------------------------------

LAB = Lab(1, "lab01_serving_loop", "The serving loop", widgets=("next step", "run to end"), exercises=(
    Exercise("split_step", "split_step", check_split_step, points=1, hidden=hidden_split_step, mutants=(
        ("first output token counted as prefill", "if start >= prompt_lens[request_id] and",
         "if start > prompt_lens[request_id] and"),
        ("classifies by chunk size", "if start >= prompt_lens[request_id] and num_tokens == 1:", "if num_tokens == 1:"),
        ("counts sequences, not tokens", "prefill += num_tokens", "prefill += 1"),
        ("returns (decode, prefill)", "return prefill, decode", "return decode, prefill"),
        ("last prompt token counted as decode", "if start >= prompt_lens[request_id] and",
         "if start >= prompt_lens[request_id] - 1 and"),
        # the signature's container is part of the contract: kills a Case that compares lists and tuples alike
        ("returns a list, not the signature's tuple", "return prefill, decode", "return [prefill, decode]"),
        ("a recompute chunk running past the prompt counted as decode",
         "if start >= prompt_lens[request_id] and num_tokens == 1:", "if start + num_tokens > prompt_lens[request_id]:"),
        ("a recompute chunk starting past the prompt counted as decode",
         "if start >= prompt_lens[request_id] and num_tokens == 1:", "if start >= prompt_lens[request_id]:"),
        ("splits a chunk at the prompt's end", "        if start >= prompt_lens[request_id] and num_tokens == 1:\n"
         "            decode += num_tokens\n        else:\n            prefill += num_tokens\n",
         "        in_prompt = max(0, min(num_tokens, prompt_lens[request_id] - start))\n"
         "        prefill += in_prompt\n        decode += num_tokens - in_prompt\n"),
    )),
    Exercise("static_batching", "StaticBatching", check_static_batching, points=1, hidden=hidden_static_batching,
             mutants=(
        ("continuous batching (always admits)", "return [] if running else list(waiting)", "return list(waiting)"),
        ("never admits", "return [] if running else list(waiting)", "return []"),
        ("newest first", "return [] if running else list(waiting)", "return [] if running else list(reversed(waiting))"),
        ("one request per batch", "return [] if running else list(waiting)", "return [] if running else list(waiting)[:1]"),
        ("admits while fewer than 2 run", "return [] if running else", "return [] if len(running) > 1 else"),
        ("inverted condition", "return [] if running else list(waiting)", "return list(waiting) if running else []"),
    )),
))
