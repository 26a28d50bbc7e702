"""The reads the fleet simulator makes cheaper, against independent counts: an engine's batch read of output tokens
(against a count of the tokens each request's rows sampled, read off the step log), a step log without per-tenant
rows where the config turns them off (the fleet's replicas), and the ``until`` stop with a request refused at the
door before it (against the same fleet run to the end)."""

from __future__ import annotations

import pytest

from minivllm.arrival import Arrival
from minivllm.config import EngineConfig
from minivllm.labs.workloads import sim_engine
from minivllm.sampling_params import SamplingParams
from minivllm.sim.fleet import ChatMix, Fleet, run_fleet, sim_replica
from minivllm.sim.router import RoundRobinRouter

SMALL = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=64, model_max_len=512)


def _tenant_engine(**options):
    engine = sim_engine(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64, **options)
    for k in range(6):
        engine.add_request({"prompt_token_ids": [11 + k] * (20 + 9 * k)}, SamplingParams(max_tokens=12, ignore_eos=True),
                           request_id=f"q{k}", tenant="ab"[k % 2])
    return engine


def test_num_output_tokens_counts_the_rows_that_sampled_and_zero_for_an_unknown_id():
    """Oracle: a request's output tokens so far are the rows of it that reached its current end -- the last
    prompt chunk and each decode -- counted by hand from the step log's ``(id, start, tokens)`` rows."""
    engine = _tenant_engine()
    prompt_len = {f"q{k}": 20 + 9 * k for k in range(6)}
    sampled = dict.fromkeys(prompt_len, 0)
    for _ in range(8):  # (short of the end: every request still in the engine)
        engine.step()
        for rid, start, n in engine.step_log[-1].seqs:
            sampled[rid] += start + n >= prompt_len[rid]
    ids = [*prompt_len, "nobody"]
    counts = engine.num_output_tokens(ids)
    assert counts == [sampled[rid] for rid in prompt_len] + [0]
    assert 0 < min(counts[:-1]) and max(counts) < 12  # (mid-run: some tokens each, none finished)


def test_step_log_tenants_off_leaves_the_tenant_fields_empty_and_the_rest_of_the_log_the_same():
    """Two engines on the same two-tenant requests: with ``step_log_tenants=False`` every record has no tenant
    rows, and every other field reads as with them on (whose records do have tenant rows)."""
    on, off = _tenant_engine(), _tenant_engine(step_log_tenants=False)
    for _ in range(30):
        on.step(), off.step()
    assert all(r.tenants and r.seq_tenants for r in on.step_log if r.seq_ids)
    assert all(not r.tenants and not r.seq_tenants for r in off.step_log)

    def rest(record):
        return {k: getattr(record, k) for k in record.__dataclass_fields__ if k not in ("tenants", "seq_tenants")}

    assert [rest(r) for r in off.step_log] == [rest(r) for r in on.step_log]
    with pytest.raises(ValueError, match="step_log_tenants must be bool"):
        EngineConfig(step_log_tenants="no")


def test_a_fleet_replica_logs_no_tenant_rows_unless_asked():
    """ChatMix names two tenants ("chat", "single"): a replica would log per-tenant rows every step, which no
    figure of the fleet reads.  An explicit option still turns them on."""
    mix = ChatMix(30.0, 1.0, seed=1, system_len=32, user_range=(8, 16), output_range=(2, 6), turns=2,
                  think_s=(0.1, 0.2), answer_s=0.5)
    fleet = Fleet(2, RoundRobinRouter(), engine_factory=lambda ex: sim_replica(ex, **SMALL))
    fleet.run(mix.arrivals(), follow_up=mix.follow_up)
    logs = [r for e in fleet.engines for r in e.step_log]
    assert {a.tenant for a in mix.arrivals()} == {"chat", "single"} and logs
    assert not any(r.tenants for r in logs)
    asked = Fleet(1, RoundRobinRouter(), engine_factory=lambda ex: sim_replica(ex, step_log_tenants=True, **SMALL))
    asked.run(mix.arrivals(), follow_up=mix.follow_up)
    assert any(r.tenants for r in asked.engines[0].step_log)


def test_a_request_refused_before_until_does_not_hold_the_stop():
    """A prompt longer than the replica's ``max_model_len`` is refused at the door: it is an error result and
    nothing in flight, so the run still stops at ``until`` (before the late request) -- and the requests
    before ``until`` read as in the same run to the end."""
    small = dict(SMALL, model_max_len=128)
    arrivals = [Arrival(0.0, "a", "t", tuple(range(10, 40)), 4),
                Arrival(0.01, "too-long", "t", tuple(range(10, 300)), 4),
                Arrival(0.02, "b", "t", tuple(range(50, 70)), 3),
                Arrival(5.0, "late", "t", tuple(range(10, 40)), 100)]

    def run(until):
        return run_fleet(arrivals, 1, "round_robin", engine_factory=lambda ex: sim_replica(ex, **small), until=until)

    whole, cut = run(None), run(4.0)
    assert cut.until == 4.0 and "late" not in cut.placement  # (stopped with the late request still to come)
    assert cut.result("too-long").outcome == "error"
    assert [cut.result(r) for r in ("a", "too-long", "b")] == [whole.result(r) for r in ("a", "too-long", "b")]
