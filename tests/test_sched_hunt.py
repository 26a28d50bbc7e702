"""A bug hunt through the scheduler and its fairness policies, held to what their docstrings promise.

Each test drives the real engine on the simulated executor (every KV slot a step attends checked by
:class:`~invariants.KVContents`) and reads the answer off the step log; the oracle is the rule as documented,
worked by hand for a scripted workload.
"""

from __future__ import annotations

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig, ThreeClassConfig

from invariants import KVContents, assert_no_leak, drain  # noqa: E402  (tests/ is on sys.path)


def _first_rows(engine, since: int) -> dict[str, int]:
    """The step (index into the step log) at which each request got its first row at or after step ``since``."""
    first: dict[str, int] = {}
    for i, rec in enumerate(engine.step_log[since:], start=since):
        for rid, _, _ in rec.seqs:
            first.setdefault(rid, i)
    return first


def test_three_class_a_batch_victim_is_not_passed_by_its_own_tenants_newer_batch_request():
    """Three-class admission has a per-tenant head of line: a tenant whose head request cannot start lets other
    tenants pass, never its own later requests.  And it preempts only for a strictly better class ("inside one
    class a preemption would trade one request's work for an equal one's, which is thrash").  So when "x"
    (interactive) preempts "v" (batch, tenant b) to get blocks, v is tenant b's head -- it ranks ahead of b's
    newer batch request "w" (same class and priority, earlier arrival) and cannot start again in that pass -- and
    w must not take the room v gave up.

    Hand-worked: 16 blocks of 4 tokens, no interactive reserve.  v (56 + 8 tokens) holds 15 blocks after four
    steps, 1 is free.  x (6 tokens, 2 blocks) needs v to go.  Beside x (3 blocks at most) the 13 blocks left
    cannot hold v (15), so v restarts once x is done; w (6 + 20 tokens, up to 7 blocks) beside v (15) does not fit
    either, so w runs after v.  Order of first rows after the preemption: x, then v, then w.  The old code
    admitted w with x in the pass that preempted v, and v waited for w's 20 outputs too."""
    cfg = EngineConfig(num_gpu_blocks_override=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=64, scheduling_policy="three_class", device="cpu",
                       tenants={"b": TenantConfig(priority_class="batch"),
                                "i": TenantConfig(priority_class="interactive")},
                       # batch stays in the order beside one waiting interactive request; victims are recomputed
                       three_class=ThreeClassConfig(interactive_kv_reserve=0.0, batch_max_interactive_queue=4,
                                                    swap_min_tokens=10_000))
    engine = LLMEngine(cfg, executor=KVContents(4), model_max_len=64, eos_token_ids=set())

    def add(rid, tenant, token, prompt_len, max_tokens):
        engine.add_request({"prompt_token_ids": [token] * prompt_len},
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid, tenant=tenant)

    add("v", "b", 11, 56, 8)
    for _ in range(4):
        engine.step()
    assert engine.pool.num_free == 1
    add("x", "i", 12, 6, 4)
    add("w", "b", 13, 6, 20)
    drain(engine)
    preempting = [i for i, rec in enumerate(engine.step_log) if rec.preempted]
    assert [engine.step_log[i].preempted for i in preempting] == [("v",)]
    first = _first_rows(engine, preempting[0])
    assert first["x"] == preempting[0], "x is seated in the pass that preempted v"
    assert first["x"] < first["v"] < first["w"], first
    assert_no_leak(engine)
