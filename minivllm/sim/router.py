"""Routers: which replica of a fleet serves the next request.

A router sees what a load balancer in front of N engines can see: the
prompt's token ids and, per replica, the *outstanding tokens* of the
requests it sent there: a request counts its prompt plus its ``max_tokens``
from the moment it is routed, the prompt leaves the count with the first
token streamed back, and each output token as it streams.  It never looks
inside an engine.  Three policies, from blind to cache-aware:

* :class:`RoundRobinRouter` -- 0, 1, 2, ... regardless of load or content.
* :class:`LeastOutstandingRouter` -- the replica with the fewest outstanding
  tokens (ties to the lowest index): balances work, ignores the caches.
* :class:`PrefixAffinityRouter` -- consistent hashing of the prompt's first
  ``key_blocks`` KV blocks onto a ring with virtual nodes, so requests that
  share those blocks (a conversation's turns, a long system prompt) land on
  the replica whose prefix cache already holds them; when that owner has
  more than its bound of outstanding tokens the request spills over to the
  least-loaded replica, so one hot prefix cannot melt one machine.

Why consistent hashing and not ``hash(key) % N``?  With modulo, adding a
replica remaps almost every key and every replica's cache goes cold at once;
on a ring only the keys between the new replica's points and their
predecessors move -- about 1/(N+1) of them.  Virtual nodes (many points per
replica) even out the arc lengths, so each replica owns about 1/N of the ring.

All routers implement :class:`minivllm.interfaces.Router`.
"""

from __future__ import annotations

import bisect
import hashlib
import operator
import struct
from collections.abc import Sequence

from minivllm.argtypes import is_int, is_real
from minivllm.sampling_params import brief_repr

ROUTERS = ("round_robin", "least_outstanding", "prefix_affinity")


def stable_hash(data: bytes | str | Sequence[int]) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` of a str is salted per process).

    Token ids are packed as unsigned 32-bit integers, so ``stable_hash([1, 2])``
    and ``stable_hash("1,2")`` differ, and equal token lists always agree.
    """
    if isinstance(data, str):
        raw = data.encode()
    elif isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    else:
        try:
            raw = struct.pack(f"<{len(data)}I", *data)
        except struct.error:  # an id outside uint32 (one the engine will refuse, say): a key all the same, never a
            # crash inside the router, which runs before the engine can refuse the prompt on its own terms
            raw = b"\xffids:" + ",".join(_id_text(x) for x in data).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def _id_text(x) -> str:
    """A token id as text for :func:`stable_hash`'s fallback: an integer's digits, anything else its ``repr``.

    Not ``int(x)`` for everything: a string, ``None`` or NaN in a prompt raised inside the router, ending a
    fleet's whole run, where the engine would have refused that one request (as it does behind round robin)."""
    try:
        return str(operator.index(x))
    except TypeError:
        return repr(x)


def prefix_key(prompt_token_ids: Sequence[int], block_size: int, key_blocks: int) -> int:
    """The routing key of a prompt: the hash of its first ``key_blocks`` *full* KV blocks.

    Full blocks only, because those are what a prefix cache can hold; a prompt
    shorter than one block is keyed on all of it.  Two prompts with the same
    first ``key_blocks * block_size`` tokens get the same key, whatever follows.
    """
    full = min(key_blocks, len(prompt_token_ids) // block_size)
    head = prompt_token_ids[: full * block_size] if full else prompt_token_ids
    return stable_hash(list(head))


def _check_loads(loads: Sequence[int]) -> None:
    if not loads:
        raise ValueError("a router needs at least one replica")


class RoundRobinRouter:
    """Replicas in turn: the baseline every load balancer ships with."""

    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica after the last one chosen; taken modulo the replicas *now*, so a caller that grows or
        shrinks its fleet between calls gets an index in range, not the old fleet's next one."""
        _check_loads(loads)
        choice = self.next % len(loads)
        self.next = choice + 1
        return choice


class LeastOutstandingRouter:
    """The replica with the fewest outstanding tokens; the lowest index on ties.

    Tokens, not requests: one request with an 8K-token prompt is more work than
    ten chat turns, and a request count cannot tell them apart.
    """

    name = "least_outstanding"

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[int]) -> int:
        _check_loads(loads)
        return min(range(len(loads)), key=lambda i: (loads[i], i))


class HashRing:
    """A consistent-hash ring: ``vnodes`` points per replica at ``stable_hash(f"replica-{r}#{v}")``.

    A key belongs to the first point clockwise from it (at or after its hash,
    wrapping past the top of the 64-bit range back to the smallest point).
    """

    def __init__(self, num_replicas: int, vnodes: int = 64) -> None:
        # (bool is an int to isinstance: True would build a ring of one replica and pass for a count)
        if not is_int(num_replicas) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {brief_repr(num_replicas)}")
        if not is_int(vnodes) or vnodes < 1:
            raise ValueError(f"vnodes must be a positive int, got {brief_repr(vnodes)}")
        self.num_replicas, self.vnodes = num_replicas, vnodes
        points = sorted((stable_hash(f"replica-{r}#{v}"), r) for r in range(num_replicas) for v in range(vnodes))
        self.hashes = [h for h, _ in points]
        self.owners = [r for _, r in points]

    def owner(self, key: int) -> int:
        i = bisect.bisect_left(self.hashes, key)
        return self.owners[i % len(self.owners)]


class PrefixAffinityRouter:
    """Consistent hashing on the first blocks, with load-aware spill-over.

    ``key_blocks`` sets what "same prefix" means: with a 64-token system
    prompt and ``block_size=16``, a key of 4 blocks sends *every* request to one
    replica (it only sees the system prompt), while 8 blocks also covers the
    start of each conversation, so conversations spread and each one's turns
    stay together.  The owner is overloaded when its outstanding tokens exceed
    ``max(min_spill_tokens, spill_factor * mean load)``; then the request goes
    to the least-loaded replica instead (a cache miss there, but no hot spot).

    The key has a ceiling as well as a floor: it must not be longer than a
    conversation's *first* turn.  A first turn of 6 full blocks is keyed on those
    6; its second turn, 20 blocks long, on its first ``key_blocks`` -- another
    key, so most likely another replica, and the history is prefilled again.
    Pick ``key_blocks`` between the shared system prompt and the shortest first
    turn; a router that follows the longest prefix it has routed before (a
    radix tree of keys, as SGLang's router keeps) removes the ceiling, at the
    cost of state in the router.
    """

    name = "prefix_affinity"

    def __init__(self, num_replicas: int, *, block_size: int = 16, key_blocks: int = 16, vnodes: int = 64,
                 spill_factor: float = 1.5, min_spill_tokens: int = 4096) -> None:
        for name, value, least in (("block_size", block_size, 1), ("key_blocks", key_blocks, 1),
                                   ("min_spill_tokens", min_spill_tokens, 0)):  # (0: spill on the mean alone)
            if not is_int(value) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {brief_repr(value)}")
        if not (is_real(spill_factor) and spill_factor >= 1.0):
            raise ValueError(f"spill_factor must be a finite number >= 1, got {brief_repr(spill_factor)}")
        self.ring = HashRing(num_replicas, vnodes)
        self.block_size, self.key_blocks = block_size, key_blocks
        self.spill_factor, self.min_spill_tokens = float(spill_factor), min_spill_tokens
        self.num_spilled = 0

    @property
    def points(self) -> list[int]:
        """The ring's points (64-bit hashes), sorted."""
        return self.ring.hashes

    @property
    def owners(self) -> list[int]:
        """The replica of each point in :attr:`points`."""
        return self.ring.owners

    def owner(self, prompt_token_ids: Sequence[int]) -> int:
        """The replica the ring assigns this prompt's prefix to, ignoring load."""
        return self.ring.owner(prefix_key(prompt_token_ids, self.block_size, self.key_blocks))

    def bound(self, loads: Sequence[int]) -> float:
        """Outstanding tokens above which the owner is skipped."""
        return max(self.min_spill_tokens, self.spill_factor * sum(loads) / len(loads))

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[int]) -> int:
        _check_loads(loads)
        if len(loads) != self.ring.num_replicas:
            raise ValueError(f"the ring has {self.ring.num_replicas} replicas, got loads for {len(loads)}")
        owner = self.owner(prompt_token_ids)
        if loads[owner] <= self.bound(loads):
            return owner
        self.num_spilled += 1
        return min(range(len(loads)), key=lambda i: (loads[i], i))


def make_router(name: str, num_replicas: int, **options) -> "RoundRobinRouter | LeastOutstandingRouter | PrefixAffinityRouter":
    """A router by name (``ROUTERS``); ``options`` go to :class:`PrefixAffinityRouter`."""
    if name == "round_robin":
        return RoundRobinRouter()
    if name == "least_outstanding":
        return LeastOutstandingRouter()
    if name == "prefix_affinity":
        return PrefixAffinityRouter(num_replicas, **options)
    raise ValueError(f"unknown router {brief_repr(name)}; choose one of {', '.join(ROUTERS)}")
