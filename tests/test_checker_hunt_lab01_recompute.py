"""Lab 1's ``split_step`` against answers that misread a recompute chunk.

After a recompute preemption the engine runs a victim's prompt and generated tokens again in one sequence
``(rid, 0, prompt + generated)``: it starts inside the prompt and ends past it.  No visible (or hidden) case had
such a sequence, so an answer deciding by where a sequence *ends* (``start + num_tokens > prompt_len`` -> decode),
or splitting it at the prompt's end, passed both.  Oracle: the timeline's split
(:func:`minivllm.labs.widgets.step_composition`, the lab's fallback), on a real engine run that preempts."""

from __future__ import annotations

from minivllm.labs import check_lab01
from minivllm.labs.widgets import step_composition
from minivllm.labs.workloads import random_requests, run_engine, sim_engine
from tests.checker_verdicts import accepts, refuses


def _by_end(seqs, prompt_lens):
    prefill = decode = 0
    for rid, start, n in seqs:
        if start + n > prompt_lens[rid]:
            decode += n
        else:
            prefill += n
    return prefill, decode


def _split_at_prompt_end(seqs, prompt_lens):
    prefill = decode = 0
    for rid, start, n in seqs:
        in_prompt = max(0, min(n, prompt_lens[rid] - start))
        prefill, decode = prefill + in_prompt, decode + n - in_prompt
    return prefill, decode


def _by_start_only(seqs, prompt_lens):  # the lab's reference before a chunked recompute was checked
    prefill = decode = 0
    for rid, start, n in seqs:
        if start >= prompt_lens[rid]:
            decode += n
        else:
            prefill += n
    return prefill, decode


def test_the_checkers_run_has_recompute_chunks_and_both_wrong_answers_miscount_them():
    eng = sim_engine(block_size=4, max_num_batched_tokens=256, num_blocks=12)
    reqs = random_requests(4, seed=2, prompt_range=(5, 30), output_range=(20, 40))
    run_engine(eng, reqs)
    lens = {f"r{i}": len(p) for i, (p, _) in enumerate(reqs)}
    chunks = [(r, s, n) for e in eng.step_log for r, s, n in e["seqs"] if s < lens[r] < s + n]
    assert chunks, "the run no longer preempts: the case tests nothing"
    rid, start, n = chunks[0]
    seqs = [(rid, start, n)]
    assert step_composition(seqs, lens) == (n, 0)
    assert _by_end(seqs, lens) == (0, n)
    assert _split_at_prompt_end(seqs, lens) == (lens[rid], n - lens[rid])


def test_answers_that_misread_a_recompute_chunk_fail_the_checker():
    for wrong in (_by_end, _split_at_prompt_end):
        refuses(check_lab01.check_split_step, wrong, "a preempted request's recompute is prefill",
                "where a sequence starts")
    accepts(check_lab01.check_split_step, step_composition)  # (the lab's own answer: tests/test_labs.py)


def test_a_chunked_recompute_starting_past_the_prompt_is_prefill():
    """Under a budget of 16 the recompute comes in chunks and a later one starts past the prompt
    (``('r1', 16, 16)`` with a 13-token prompt): the model computes 16 tokens it had generated before, prefill
    work, which the timeline colours as prefill.  Deciding by ``start`` alone (the lab's reference until this
    case) counted them as 16 decode tokens; the checker now says so."""
    eng = sim_engine(block_size=4, max_num_batched_tokens=16, num_blocks=16)
    reqs = random_requests(4, seed=2, prompt_range=(5, 30), output_range=(20, 40))
    run_engine(eng, reqs)
    lens = {f"r{i}": len(p) for i, (p, _) in enumerate(reqs)}
    past = [(r, s, n) for e in eng.step_log for r, s, n in e["seqs"] if s >= lens[r] and n > 1]
    assert past, "the run no longer recomputes in chunks: the case tests nothing"
    assert all(step_composition([c], lens) == (c[2], 0) for c in past)
    refuses(check_lab01.check_split_step, _by_start_only, "a recompute chunk past the prompt is prefill")
