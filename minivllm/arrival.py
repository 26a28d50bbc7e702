"""A timed request of a workload: what an open-loop client sends, and when.

Why a module of its own?  The labs (4, 5, 6), the fairness benchmark and the fleet simulation all replay the
same thing -- a request that arrives at a time -- and each once had its own class for it.  Here, beside
:mod:`minivllm.request` (the request *inside* the engine), it depends on nothing, so ``minivllm.sim``,
``minivllm.bench`` and ``minivllm.labs`` all import it without a cycle.
"""

from __future__ import annotations

import random
from dataclasses import KW_ONLY, dataclass


@dataclass(frozen=True)
class Arrival:
    """One request of a workload: when it arrives, its id, whose it is, its prompt ids and its output length.

    One class for every driver that replays token-id requests on a clock: the labs' :func:`serve` loops, the
    fairness benchmark's :class:`~minivllm.bench.fairness.ArrivalDriver` and :class:`~minivllm.sim.fleet.Fleet`.
    A driver reads the fields it knows and ignores the rest, so a field one of them adds comes with a default the
    others never see, and it is keyword-only: a call cannot put a deadline where a priority belongs.

    ``request_id`` names the request, since the labs' tables, lab 6's retry client and the fleet's results find
    requests by id.  ``prompt`` is a tuple: an arrival is a value (hashable, safe to share between runs of
    several policies) and the fleet's routers key on slices of it.  ``deadline`` is an absolute time;
    ``priority`` is lower-runs-first under ``scheduling_policy="priority"``.  ``session`` and ``turn`` place a call
    in a *closed-loop* session -- an agent's task or a user's chat, whose next call exists only once this one has
    finished, since its send time and its prompt (the conversation so far) depend on the finish -- ``turn`` 0 being
    its first.  One idea, so one pair of fields: what differs is only the rule that makes the next call, and that
    belongs to the driver -- :func:`~minivllm.bench.fairness.next_agent_call` for
    :class:`~minivllm.bench.fairness.ArrivalDriver`'s agents, :meth:`~minivllm.sim.fleet.ChatMix.follow_up` for the
    fleet's chats.

    Three look-alikes stay apart because they carry something else: :class:`minivllm.labs.live.SimArrival` has
    only a prompt length, its token ids made up when the request is added; :class:`minivllm.sim.run.SimRequest`
    is numbered by an index, with a sample count and times relative to the run's start, as ``sim run``'s
    real-vs-simulated comparison needs; :class:`minivllm.bench.loadgen.PlannedRequest` holds a text prompt for an
    HTTP server to tokenize.
    """

    time: float
    request_id: str
    tenant: str
    prompt: tuple[int, ...]
    max_tokens: int
    _: KW_ONLY
    deadline: float | None = None
    priority: int = 0
    session: int | None = None
    turn: int = 0


MADE_UP_IDS = (10, 900)  # a made-up prompt's token ids: clear of the ids 0-9 tokenizers reserve (BOS, EOS, pad)


def made_up_ids(rng: random.Random, n: int, ids: tuple[int, int] = MADE_UP_IDS) -> list[int]:
    """``n`` token ids drawn uniformly from ``range(*ids)``: the prompt of a request whose text does not matter.

    The one definition behind every made-up prompt of the labs and benchmarks, so that a workload's ids come
    from one rule: ``rng.randrange`` one id at a time, which is what a seeded workload's committed numbers were
    drawn with -- another draw would give other prompts and move them.  A caller with a different vocabulary
    passes its own ``ids`` (lab 6's mixes draw below 990; the fleet's chats over the whole fake vocabulary).
    """
    lo, hi = ids
    return [rng.randrange(lo, hi) for _ in range(n)]


__all__ = ["Arrival", "MADE_UP_IDS", "made_up_ids"]
