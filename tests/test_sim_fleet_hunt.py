"""Defects found reading the fleet simulator (stop 69's hunt); each oracle is a count made by hand.

* A fleet run a second time keeps its engines, so a warm prefix cache carries over (the point of running it
  again); its :class:`ReplicaStats` must still describe that run alone, as its requests and steps do.
* ``FleetResult.summary(window=...)`` divides by the window's length: an empty or reversed one is an error.
* A roofline replica's engine must use its executor's blocks, or the pool holds twice or half the device's KV.
* :class:`ChatMix` draws lengths with ``randint``: a bad range is a ValueError that names it.
"""

import pytest

from minivllm.arrival import Arrival
from minivllm.sim.fleet import ChatMix, Fleet, roofline_factory, run_fleet, sim_replica
from minivllm.sim.router import RoundRobinRouter

SMALL = dict(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256, model_max_len=1024)


def _small(executor):
    return sim_replica(executor, **SMALL)


def test_a_second_run_counts_its_own_cache_lookups():
    """Run 1 sends one 40-token prompt: nothing cached, 40 tokens looked up.  Run 2 sends the same prompt again,
    later on the clock: its two full 16-token blocks are in the cache from run 1, so 32 of 40 tokens hit.  The
    second result said 32 hits of 80 looked-up tokens (run 1's lookups added in), a hit rate of 0.4."""
    prompt = tuple(range(10, 50))
    fleet = Fleet(1, RoundRobinRouter(), engine_factory=_small)
    first = fleet.run([Arrival(0.0, "a", "t", prompt, 4)])
    assert (first.replicas[0].hit_tokens, first.replicas[0].query_tokens) == (0, 40)
    second = fleet.run([Arrival(100.0, "b", "t", prompt, 4)])
    st = second.replicas[0]
    assert (st.requests, st.prompt_tokens) == (1, 40)
    assert (st.hit_tokens, st.query_tokens, st.preemptions) == (32, 40, 0)
    assert second.hit_rate == pytest.approx(32 / 40)
    assert second.summary()["prefix_hit_rate"] == pytest.approx(32 / 40)
    # the windowed recount, built from this run's requests only, agrees
    assert second.summary(window=(0.0, 1e9))["prefix_hit_rate"] == pytest.approx(32 / 40)


def test_a_second_run_counts_its_own_preemptions():
    """Run 1: two requests of 40 + 60 tokens (7 blocks of 16 each) on a pool of 8 blocks, so one is preempted.
    Run 2: one request of 20 + 4 tokens (2 blocks) on the drained pool, which nothing can preempt.  The second
    result reported run 1's preemption as its own."""
    tight = dict(SMALL, num_blocks=8, model_max_len=128)
    fleet = Fleet(1, RoundRobinRouter(), engine_factory=lambda ex: sim_replica(ex, **tight))
    first = fleet.run([Arrival(0.0, "a", "t", tuple(range(10, 50)), 60),
                       Arrival(0.0, "b", "t", tuple(range(100, 140)), 60)])
    assert first.replicas[0].preemptions >= 1  # (the precondition: run 1 did preempt)
    second = fleet.run([Arrival(100.0, "c", "t", tuple(range(200, 220)), 4)])
    assert second.replicas[0].preemptions == 0
    assert second.summary()["preemptions"] == 0


@pytest.mark.parametrize("window", [(1.0, 1.0), (2.0, 1.0), (0.0, float("inf"))])
def test_a_window_without_a_positive_finite_length_is_refused(window):
    """Rates are per second of the window: (1, 1) divided by zero (ZeroDivisionError), (2, 1) gave an offered
    rate of -0.0 requests/s, and an endless window rates of 0."""
    res = run_fleet([Arrival(0.0, "a", "t", tuple(range(10, 50)), 4)], 1, "round_robin", engine_factory=_small)
    with pytest.raises(ValueError, match="window"):
        res.summary(window=window)


def test_a_roofline_replica_uses_its_executors_blocks():
    """Llama-3-8B on an L4 in 32-token blocks: 90% of its memory less 16 GB of weights, in blocks of 32 tokens of
    128 KiB each, is 1,353 blocks (43,296 tokens).  The engine took REPLICA's 16-token blocks while the pool was
    counted in the executor's 32-token ones: 1,353 blocks of 16, half the device's KV."""
    from minivllm.sim.presets import hardware_preset, model_preset

    shape, l4 = model_preset("llama-3-8b"), hardware_preset("l4")
    free = int(0.9 * l4.memory_bytes - shape.num_params * shape.dtype_bytes)
    by_hand = free // (32 * shape.kv_bytes_per_token)
    assert by_hand == 1353
    engine = sim_replica(roofline_factory("l4", "llama-3-8b", block_size=32)())
    assert (engine.config.block_size, engine.pool.num_blocks) == (32, by_hand)
    # an engine told other blocks than its executor's would hold twice the device's KV: refused, naming both
    with pytest.raises(ValueError, match="block_size=32 .* 16"):
        sim_replica(roofline_factory("l4", "llama-3-8b")(), block_size=32)


@pytest.mark.parametrize("bad", [dict(user_range=(256, 64)), dict(output_range=(0, 3)), dict(output_range=(8, 4)),
                                 dict(output_range=(4.5, 8))])
def test_chat_mix_length_ranges_are_checked(bad):
    """A reversed user range failed inside ``random`` ("empty range for randrange()"), naming no argument; an
    output range reaching 0 made every 0-token turn a request the engine refuses (a silent error that ends its
    chat); a float one failed inside ``randint``."""
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        ChatMix(4.0, 2.0, seed=1, answer_s=1.0, **bad)


def test_prefix_affinity_lets_the_engine_refuse_a_prompt_of_non_integers():
    """A prompt holding a string, None or NaN crashed the whole run inside ``stable_hash`` (``int("a")``) behind
    prefix affinity; behind round robin the engine refuses that one request and the run goes on.  The oracle is
    the round-robin run: the same outcomes, request by request."""
    good = tuple(range(10, 50))
    arrivals = [Arrival(0.0, "good", "t", good, 2), Arrival(0.1, "str", "t", ("a", "b"), 2),
                Arrival(0.2, "none", "t", (None,), 2), Arrival(0.3, "nan", "t", (float("nan"),), 2)]
    want = [r.outcome for r in run_fleet(arrivals, 2, "round_robin", engine_factory=_small).results]
    assert want == ["ok", "error", "error", "error"]
    got = run_fleet(arrivals, 2, "prefix_affinity", engine_factory=_small).results
    assert [r.outcome for r in got] == want


def test_the_fallback_key_spells_integers_as_before_and_anything_else_by_repr():
    """The fallback key (ids that do not pack as uint32) for integers is unchanged -- the digits after a marker,
    hashed, computed here by hand -- and a string or None is spelled by its repr instead of raising."""
    import hashlib

    from minivllm.sim.router import stable_hash

    def by_hand(text: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(b"\xffids:" + text, digest_size=8).digest(), "little")

    assert stable_hash([-1, 5]) == by_hand(b"-1,5")
    assert stable_hash([2**40]) == by_hand(str(2**40).encode())
    assert stable_hash(["a", None]) == by_hand(b"'a',None")


@pytest.mark.parametrize("bad", [dict(num_system_prompts=0), dict(num_system_prompts=True), dict(vocab=10),
                                 dict(vocab=True)])
def test_chat_mix_counts_are_checked(bad):
    """No system prompt to open a chat with (an IndexError later, from ``random.choice``), or token ids drawn from
    ``range(10, vocab)`` with vocab <= 10 (a ValueError inside ``random``): each named at the call instead."""
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        ChatMix(4.0, 2.0, seed=1, answer_s=1.0, **bad)


@pytest.mark.parametrize("args", [(True,), (2, True)])
def test_a_hash_ring_refuses_a_bool_for_a_count(args):
    """``isinstance(True, int)`` holds: ``HashRing(True)`` built a ring of one replica and passed for a count."""
    from minivllm.sim.router import HashRing

    with pytest.raises(ValueError, match="must be a positive int, got True"):
        HashRing(*args)


def test_a_gpu_profile_whose_model_is_null_reads_as_one_without_a_model():
    """A hand-edited profile with ``"model": null`` raised AttributeError in ``profile_spec``; the oracle is the same
    profile with no ``model`` key at all (the 2-byte default the function already applies)."""
    import dataclasses

    from minivllm.sim.presets import hardware_preset, profile_spec

    h200 = dataclasses.replace(hardware_preset("h200"), memory_bytes=0)  # (so the datasheet fills something)
    doc = {"device": "cuda", "hardware": dataclasses.asdict(h200)}
    assert profile_spec({**doc, "model": None}) == profile_spec(doc)
