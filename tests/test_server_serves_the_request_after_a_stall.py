"""After the stall watchdog fired, the server serves the next request in full, not with the stall's error.

Why: a mutation pass over the server found that no server test noticed the watchdog's count of empty steps
left running on after a stall (``LLMEngine._watch_progress`` not zeroing ``_idle_steps`` once it failed the
stuck requests).  The served deadlock test mends its policy before the next request, which then runs on its
first step, so the stale count never gets a turn.  A policy that is legitimately *waiting* -- a batching window,
a second arrival, the case :data:`~minivllm.engine.llm_engine.STALL_STEPS` exists for -- does hold the next
request for a few empty steps, and with the stale count the first of them was already "step 65" of the old
stall, so the request was failed at once with a deadlock message it never caused.

Oracles: the documented watchdog (``STALL_STEPS`` empty steps in a row, counted per stall) and the simulated
executor's published token function (:func:`~minivllm.sim.roofline.fake_token` of the request id and the
position), which fixes every token a request gets whatever the scheduling.
"""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import STALL_STEPS, LLMEngine  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from minivllm.sim.roofline import fake_token  # noqa: E402
from tests.test_server_sim import _serving, _WordTokenizer  # noqa: E402

WINDOW = 3  # empty steps the mended policy holds a request: far under STALL_STEPS, so nothing may fail


class _DeadlockThenWindow:
    """Admits no one while ``refuse``; after that, holds whatever waits for ``WINDOW`` steps, then admits it all
    (a batching window counted in steps: the policy waits for more arrivals, the engine is not stuck)."""

    def __init__(self) -> None:
        self.refuse = True
        self.held = 0

    def order(self, waiting, running):
        if self.refuse or not waiting:
            return []
        if self.held < WINDOW:
            self.held += 1
            return []
        self.held = 0
        return list(waiting)


def test_a_request_held_by_a_waiting_policy_right_after_a_stall_is_served_whole():
    """A deadlocked request is failed with the watchdog's 500 and its state freed; the next request, held
    ``WINDOW`` empty steps by the mended policy, must get all 5 of its own tokens and a 200.  (On the virtual
    clock, which stands still on empty steps, a stale count fails it on its first empty step.)"""
    from minivllm.server import build_app

    assert WINDOW < STALL_STEPS
    policy = _DeadlockThenWindow()
    prompt = list(range(10, 22))
    cfg = EngineConfig(num_gpu_blocks_override=12, block_size=4, max_model_len=40, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=_WordTokenizer(), model_max_len=40,
                       eos_token_ids=set(), admission_policy=policy)
    body = {"model": "sim", "prompt": prompt, "max_tokens": 5, "ignore_eos": True}
    with _serving(build_app(engine, ["sim"])) as base:
        stuck = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert stuck.status_code == 500, stuck.text
        assert f"no progress in {STALL_STEPS} steps" in stuck.json()["error"]["message"]
        stats = engine.stats()
        assert stats["used_blocks"] == 0 and stats["num_stalls"] == 1 and not engine.requests

        policy.refuse = False
        served = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert served.status_code == 200, served.text
        got = [int(w[1:]) for w in served.json()["choices"][0]["text"].split()]
        rid = served.json()["id"]
        assert got == [fake_token(rid, len(prompt) + i, 1000) for i in range(5)]
        stats = engine.stats()
        assert stats["num_stalls"] == 1 and stats["used_blocks"] == 0 and not engine.requests
