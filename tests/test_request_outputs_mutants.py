"""Pins for the derived values of ``Request`` and ``RequestMetrics`` / ``CompletionOutput`` that no other test
reads directly (a mutation pass on ``minivllm/request.py`` and ``minivllm/outputs.py`` left them unchecked).

Oracles are hand counts: the status enum's own list of finished states, a KV cap's size in tokens, and a 1 s
step clock on which every timestamp of a lone request is known in advance.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import TenantConfig
from minivllm.outputs import CompletionOutput
from minivllm.request import Request, RequestStatus
from minivllm.sim import SimulatedExecutor
from tests.invariants import steps

from tests.test_fairness import add, make_engine

FINISHED = {"stop", "length", "abort", "rejected", "error"}  # the finish reasons vLLM (and minivllm) report


@pytest.mark.parametrize("status", list(RequestStatus))
def test_a_request_has_a_finish_reason_only_once_it_is_finished(status):
    """Kills: ``finish_reason`` answering for any status but RUNNING, so a waiting, preempted or swapped
    request would read as finished with reason "waiting" / "preempted" / "swapped"."""
    req = Request("r", [1, 2, 3], SamplingParams(), arrival_time=0.0, status=status)
    expected = status.value if status.value in FINISHED else None
    assert req.finish_reason == expected
    assert status.finished == (expected is not None)


@pytest.mark.parametrize("reason", sorted(FINISHED))
def test_a_completion_with_any_finish_reason_is_finished(reason):
    """Kills: ``CompletionOutput.finished()`` knowing only the "natural" reasons (stop, length), so an
    aborted, rejected or failed completion would look like it is still streaming."""
    assert CompletionOutput(0, "", [], finish_reason=reason).finished()
    assert not CompletionOutput(0, "", []).finished()


def test_a_request_that_fills_its_tenants_kv_cap_exactly_is_admitted_and_one_token_more_is_refused():
    """Kills: ``max_total_tokens`` one short of prompt + max_tokens.  The engine refuses, at ``add_request``,
    a request whose worst case (every prompt token plus every token it may generate, vLLM's count) is larger
    than its tenant's KV cap could ever hold.  Hand count: 48 blocks x 0.25 = a cap of 12 blocks of 4 tokens,
    48 tokens; 40 + 8 fits it exactly and 41 + 8 does not."""
    engine = make_engine(policy="caps", tenants={"t": TenantConfig(max_kv_share=0.25)}, num_blocks=48, block_size=4)
    req = Request("r", [1] * 41, SamplingParams(max_tokens=8), arrival_time=0.0, max_tokens=8)
    assert req.max_total_tokens == 49
    add(engine, "t", 40, 8, "fits")
    with pytest.raises(ValueError, match="may hold at most 48"):
        add(engine, "t", 41, 8, "too-big")


def _lone_request_metrics(max_tokens: int):
    """The final metrics of one request, arrived at 0, on 1 s steps with one seat (every step is 1 s long)."""
    ex = SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)
    llm = LLM(executor=ex, tokenizer=None, num_gpu_blocks_override=64, max_model_len=96, max_num_seqs=1)
    engine = llm.engine
    engine.eos_token_ids = set()
    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       request_id="r", arrival_time=0.0)
    done = []
    for outs in steps(engine):
        done += [o.metrics for o in outs if o.finished]
    return done[-1]


def test_inter_token_latencies_are_every_gap_between_consecutive_tokens():
    """Kills: ``itls`` that skips the first gap (or measures gaps backwards).  Hand count on 1 s steps: the
    prefill step [0, 1] gives token 1 at 1 s and each decode step one more, so 5 tokens come at 1..5 s and
    there are 4 gaps of 1 s each."""
    m = _lone_request_metrics(5)
    assert m.token_times == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert m.itls == [1.0, 1.0, 1.0, 1.0]


def test_an_output_carries_the_prompt_text_it_was_given(tokenizer):
    """Kills: the prompt's text left off the request (``RequestOutput.prompt`` None for every prompt).  As in
    vLLM, ``prompt`` is the caller's prompt string, which a caller of a batch matches its outputs back to; a
    prompt sent as token ids has no text (None).  Oracle: the caller's own strings and the tokenizer's encode."""
    llm = LLM(executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
              num_gpu_blocks_override=64, max_model_len=256)
    llm.engine.inputs.vocab_size = len(tokenizer)
    prompts = ["Hello there", "café 😀", {"prompt_token_ids": [1, 2, 3]}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", "café 😀", None]
    assert [o.prompt_token_ids for o in outs] == [tokenizer.encode("Hello there"), tokenizer.encode("café 😀"), [1, 2, 3]]
