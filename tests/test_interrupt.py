"""A Ctrl-C (SIGINT) arriving inside an engine step, then the engine driven on to the end.

A notebook user interrupts one ``LLM.stream`` or ``LLM.generate`` call; other streams on the same engine go on.
What they are owed does not change: every stream's concatenated deltas (tokens and text) are its request's final
tokens and text, every request ends, and every KV block comes back.  A real SIGINT is raised
(``signal.raise_signal``), deterministically, at the k-th call of one function the step calls (the scheduler, the
executor, the output processor, the detokenizer, the step log), for every k the run reaches.

Oracle: the simulated executor samples ``fake_token(request_id, position)``, so each request's tokens are recounted
here from that function and the request's own stop rules (``max_tokens``, stop ids, a stop string found in the
tokenizer's decode of the tokens so far); the text is the HF tokenizer's ``decode`` of those tokens.  Neither reads
the engine.

On the old code the interrupt landed where the signal came.  Before the step's tokens joined their requests that
changed nothing a caller reads; after, the step had appended a token to every request it ran and built outputs one
by one: the tokens it never emitted were never shown (the text lost them too), a request whose stop check had not
run was scheduled again and ran past its stop, outputs built before the interrupt, final ones included, were
dropped.  Now the step holds the signal (``llm_engine._CtrlCHeld``), runs whole, keeps its outputs for the next
step call, and raises ``KeyboardInterrupt`` as it exits.
"""

import _signal
import signal
import threading

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim import SimulatedExecutor
from minivllm.sim.roofline import fake_token

VOCAB = 1000


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Ctrl-C raises ``KeyboardInterrupt`` here, as in a terminal or a notebook.  A process started in the
    background by a shell (``cmd &``, as CI may run the suite) inherits SIGINT ignored, and Python then installs no
    handler: a Ctrl-C would do nothing at all (the hold hands it on to that handler, SIG_IGN)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
PROMPT = [19556, 905, 314, 260, 1345]


def _expected(rid: str, params: SamplingParams, tok) -> tuple[list[int], str, str]:
    """``(tokens, text, finish_reason)`` of request ``rid`` recounted from the simulated executor's sampling rule."""
    ids: list[int] = []
    for i in range(params.max_tokens):
        ids.append(fake_token(rid, len(PROMPT) + i, VOCAB))
        if ids[-1] in (params.stop_token_ids or ()):
            text_ids = ids if params.include_stop_str_in_output else ids[:-1]
            return ids, tok.decode(text_ids, skip_special_tokens=True), "stop"
        text = tok.decode(ids, skip_special_tokens=True)
        for stop in params.stop_strings:
            if stop in text:
                return ids, text[:text.find(stop)], "stop"
    return ids, tok.decode(ids, skip_special_tokens=True), "length"


def _stop_string_for(rid: str, tok) -> str:
    """Two ASCII letters that first appear in ``rid``'s decoded text past its 15th character (a stop string that
    ends the request some steps in, not at its first tokens)."""
    text = tok.decode([fake_token(rid, len(PROMPT) + i, VOCAB) for i in range(16)], skip_special_tokens=True)
    for at in range(15, len(text) - 1):
        if text[at:at + 2].isascii() and text[at:at + 2].isalpha() and text.find(text[at:at + 2]) == at:
            return text[at:at + 2]
    raise AssertionError("no stop string found")  # pragma: no cover - the fake tokens are fixed


def _workload(tok) -> dict[str, SamplingParams]:
    """One request of each way to end and to report: delta, cumulative and final-only; length, stop id (its text
    kept or not), stop string; an ``n = 2`` group; and ``z``, a long one the test aborts after the interrupt."""
    return {
        "a": SamplingParams(max_tokens=12, ignore_eos=True, output_kind="delta"),
        "b": SamplingParams(max_tokens=7, ignore_eos=True, output_kind="cumulative"),
        "c": SamplingParams(max_tokens=9, ignore_eos=True, output_kind="final_only"),
        "d": SamplingParams(max_tokens=20, ignore_eos=True, output_kind="delta",
                            stop_token_ids=[fake_token("d", len(PROMPT) + 4, VOCAB)]),
        "e": SamplingParams(max_tokens=20, ignore_eos=True, output_kind="cumulative", include_stop_str_in_output=True,
                            stop_token_ids=[fake_token("e", len(PROMPT) + 6, VOCAB)]),
        "s": SamplingParams(max_tokens=16, ignore_eos=True, output_kind="cumulative",
                            stop=[_stop_string_for("s", tok)]),
        "g": SamplingParams(n=2, max_tokens=6, ignore_eos=True, output_kind="delta"),
        "z": SamplingParams(max_tokens=40, ignore_eos=True, output_kind="delta"),
    }


# Where the interrupt is raised: (name, the object whose attribute is replaced, the attribute).
BEFORE_TOKENS_JOIN = {
    "admit": lambda e: (e.scheduler, "admit"),
    "build_batch": lambda e: (e.scheduler, "build_batch"),
    "allocate": lambda e: (e.scheduler, "allocate"),
    "execute": lambda e: (e.executor, "execute"),
    "scheduler.observe": lambda e: (e.scheduler, "observe"),  # step 5, before the tokens join their requests
}
AFTER_TOKENS_JOIN = {
    "cache_new_full_blocks": lambda e: (e.kv, "cache_new_full_blocks"),  # step 5, after they joined
    "detokenizer.add_token": lambda e: (IncrementalDetokenizer, "add_token"),  # step 6
    "check_stop": lambda e: (e.outputs, "_check_stop"),
    "make_output": lambda e: (e.outputs, "_make_output"),
    "fold": lambda e: (e.outputs, "fold"),  # step 7
    "scheduler.remove": lambda e: (e.scheduler, "remove"),
    "outputs.forget": lambda e: (e.outputs, "forget"),
    "step_log.append": lambda e: (e.step_log, "append"),  # after step 7, before the step returns
}


def _run(tok, monkeypatch, where, k: int) -> tuple[bool, list[str]]:
    """Drive the workload with an interrupt at the k-th call of ``where``; whether it fired, and what went wrong."""
    engine = LLMEngine(EngineConfig(num_gpu_blocks_override=40, block_size=4, max_model_len=96, max_num_seqs=16,
                                    enable_prefix_caching=True),
                       executor=SimulatedExecutor(vocab_size=VOCAB), tokenizer=tok, eos_token_ids=set())
    start = engine.stats()["available_blocks"]
    specs = _workload(tok)
    for rid, params in specs.items():
        engine.add_request({"prompt_token_ids": PROMPT}, params, request_id=rid)
    owner, name = where(engine)
    real, calls = getattr(owner, name), [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, now (KeyboardInterrupt here, unless it is held)
        return real(*args, **kwargs)

    def fired() -> bool:
        return calls[0] >= k

    monkeypatch.setattr(owner, name, interrupted)
    seen: dict[tuple[str, int], list] = {}
    wrong = []
    aborted = z_aborted = False
    interrupts = 0
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        try:
            outputs = engine.step()
        except KeyboardInterrupt:
            outputs = []
            interrupts += 1
        if fired() and not aborted:  # the caller who pressed Ctrl-C gives up on its request; the others go on
            aborted = True
            # at once, as between any two steps: an interrupt must not leave the engine thinking a step runs
            # (z, the longest, can have ended only where the interrupt came in the last step)
            z_aborted = "z" in engine.requests
            if z_aborted and (not engine.abort_request("z") or "z" in engine.requests):
                wrong.append("the abort right after the interrupt did not end the running request z")
        for out in outputs:
            for completion in out.outputs:
                seen.setdefault((out.request_id, completion.index), []).append((out, completion))
    monkeypatch.undo()
    if interrupts != fired():
        wrong.append(f"{interrupts} KeyboardInterrupts reached the caller for {int(fired())} Ctrl-C")
    for rid, params in specs.items():
        if rid == "z":
            continue
        for index in range(params.n):
            sample = f"{rid}#{index}" if params.n > 1 else rid
            ids, text, reason = _expected(sample, params, tok)
            got = seen.get((rid, index), [])
            if not got or not got[-1][0].finished:
                wrong.append(f"{sample}: no final output")
                continue
            last = got[-1][1]
            if params.output_kind == "delta":
                final_ids, final_text = sum((c.token_ids for _, c in got), []), "".join(c.text for _, c in got)
            else:
                final_ids, final_text = last.token_ids, last.text
            if (final_ids, final_text, last.finish_reason) != (ids, text, reason):
                wrong.append(f"{sample}: final {len(final_ids)} tokens {final_text!r} ({last.finish_reason}), "
                             f"recounted {len(ids)} tokens {text!r} ({reason})")
            deltas = sum((c.delta_token_ids for _, c in got), []), "".join(c.delta_text for _, c in got)
            if params.output_kind != "final_only" and deltas != (ids, text):
                wrong.append(f"{sample}: deltas {len(deltas[0])} tokens {deltas[1]!r}, "
                             f"recounted {len(ids)} tokens {text!r}")
    if engine.has_unfinished_requests() or engine.requests:
        wrong.append(f"left in the engine: {sorted(engine.requests)}")
    stats = engine.stats()
    finished = sum(p.n for p in specs.values())  # every sample, each once: an aborted one too (TenantStats)
    if (stats["per_tenant"]["default"]["num_finished"], stats["num_errors"]) != (finished, 0):
        wrong.append(f"counted {stats['per_tenant']['default']['num_finished']} finished requests and "
                     f"{stats['num_errors']} errors, for {finished} and none")
    if engine.stats()["available_blocks"] != start:
        wrong.append(f"{engine.stats()['available_blocks']} KV blocks available at the end, {start} at the start")
    return fired(), wrong


def _every_k(tok, monkeypatch, where) -> None:
    failures = []
    k = 0
    while True:
        k += 1
        fired, wrong = _run(tok, monkeypatch, where, k)
        if not fired:
            break
        failures += [f"interrupt at call {k}: {w}" for w in wrong]
    assert k > 2, "the interrupt point is never reached more than once"
    assert not failures, "\n".join(failures[:12])


def test_the_workload_without_an_interrupt_matches_the_recount(tokenizer, monkeypatch):
    """The oracle and the harness agree with the engine when nothing is interrupted (an interrupt at a call that
    never comes), so a failure below is the interrupt's."""
    fired, wrong = _run(tokenizer, monkeypatch, BEFORE_TOKENS_JOIN["execute"], 10**9)
    assert not fired and not wrong, wrong


@pytest.mark.parametrize("point", sorted(BEFORE_TOKENS_JOIN))
def test_an_interrupt_before_the_tokens_join_loses_no_token_and_no_block(tokenizer, monkeypatch, point):
    """Held or not, a Ctrl-C in steps 1-4 changes nothing a caller reads, and an abort right after the interrupt
    ends its request at once.  Kills: ``_stepping`` clearing its in-step mark only when the step returns (the abort
    would wait, deferred, for a step that is over); a held Ctrl-C never delivered (no KeyboardInterrupt reaches the
    caller)."""
    _every_k(tokenizer, monkeypatch, BEFORE_TOKENS_JOIN[point])


@pytest.mark.parametrize("point", sorted(AFTER_TOKENS_JOIN))
def test_an_interrupt_after_the_tokens_join_loses_no_token_and_no_block(tokenizer, monkeypatch, point):
    """The step's tokens are the requests' now: held, the Ctrl-C waits for the step to end, and its outputs come
    with the next step.  Failed on the old code at every point listed: deltas a token short, text without it,
    requests run past their stop, final outputs lost."""
    _every_k(tokenizer, monkeypatch, AFTER_TOKENS_JOIN[point])


def test_ctrl_c_while_one_stream_reads_loses_no_token_of_another_stream(tokenizer, monkeypatch):
    """The case a notebook meets: two ``LLM.stream`` calls share an engine; Ctrl-C while the first one reads (its
    step is detokenizing) ends that stream and aborts its request; the second stream reads on.  Its concatenated
    deltas must be its request's tokens and their text, recounted from the simulated executor's rule.  On the old
    code the second stream lost the token the interrupted step had appended to it (its deltas one short)."""
    llm = LLM(executor=SimulatedExecutor(vocab_size=VOCAB), tokenizer=tokenizer, num_gpu_blocks_override=64,
              max_model_len=96)
    llm.engine.eos_token_ids = set()
    params = SamplingParams(max_tokens=12, ignore_eos=True, output_kind="delta")
    first = llm.stream({"prompt_token_ids": PROMPT}, params)
    second = llm.stream({"prompt_token_ids": PROMPT}, params)
    shown = [next(second)]
    next(first)  # (its output came from the same step: the next read steps the engine)
    real = IncrementalDetokenizer.add_token

    def interrupted(self, token_id):
        monkeypatch.setattr(IncrementalDetokenizer, "add_token", real)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while the next step detokenizes its first token
        return real(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(first)
    shown += list(second)
    assert shown[-1].finished and not llm.engine.has_unfinished_requests()
    ids, text, _ = _expected(second.request_id, params, tokenizer)
    assert sum((o.outputs[0].delta_token_ids for o in shown), []) == ids
    assert "".join(o.outputs[0].delta_text for o in shown) == text
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_a_step_off_the_main_thread_leaves_the_signal_handler_alone(tokenizer, monkeypatch):
    """Only the main thread receives signals, and only it may set a handler (``signal.signal`` raises ValueError
    elsewhere): a step on another thread (the server's loop) must run without touching SIGINT.  On the main thread
    the handler is swapped for the step and put back after it."""
    engine = LLMEngine(EngineConfig(num_gpu_blocks_override=40, block_size=4, max_model_len=96),
                       executor=SimulatedExecutor(vocab_size=VOCAB), tokenizer=tokenizer, eos_token_ids=set())
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
    before = signal.getsignal(signal.SIGINT)
    calls, real = [], _signal.signal
    monkeypatch.setattr(_signal, "signal", lambda *args: calls.append(args) or real(*args))
    failed = []
    worker = threading.Thread(target=lambda: failed.extend([] if engine.step() is not None else ["no outputs"]))
    worker.start()
    worker.join()
    assert not failed and calls == []
    engine.step()
    assert len(calls) == 2 and calls[-1] == (signal.SIGINT, before)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_request_that_ended_in_an_interrupted_step_is_still_held_until_its_output_is_returned(tokenizer,
                                                                                                 monkeypatch):
    """``LLM``'s router asks ``holds_any`` whether a step can still bring a request's output: a request that ended
    in a step Ctrl-C cut short is out of the engine's tables, but its final output waits for the next step -- so it
    is still held, and ``has_unfinished_requests`` still says step again.  Then its one final output comes."""
    engine = LLMEngine(EngineConfig(num_gpu_blocks_override=40, block_size=4, max_model_len=96),
                       executor=SimulatedExecutor(vocab_size=VOCAB), tokenizer=tokenizer, eos_token_ids=set())
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, ignore_eos=True), request_id="a")
    real = engine.log_step

    def log_then_ctrl_c(batch):
        real(batch)
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(engine, "log_step", log_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    assert "a" not in engine.requests  # it ended in that step
    assert engine.holds_any(["a"]) and engine.has_unfinished_requests()
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].token_ids) for o in outputs] == [
        ("a", True, [fake_token("a", len(PROMPT), VOCAB)])]
    assert not engine.holds_any(["a"]) and not engine.has_unfinished_requests() and engine.step() == []


def _one_request_engine(tok, rid="a", max_tokens=1):
    engine = LLMEngine(EngineConfig(num_gpu_blocks_override=40, block_size=4, max_model_len=96),
                       executor=SimulatedExecutor(vocab_size=VOCAB), tokenizer=tok, eos_token_ids=set())
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       request_id=rid)
    return engine


def _ctrl_c_in(engine, monkeypatch, name="log_step"):
    real = getattr(engine, name)

    def then_ctrl_c(*args):
        result = real(*args)
        signal.raise_signal(signal.SIGINT)
        return result

    monkeypatch.setattr(engine, name, then_ctrl_c)


@pytest.mark.parametrize("handler", ["ignore", "python"])
def test_a_held_ctrl_c_goes_to_a_handler_that_does_not_raise_and_the_step_returns_once(tokenizer, monkeypatch,
                                                                                        handler):
    """The signal goes to the handler it was meant for, once; a handler that does not raise (ignored, or a
    program's own that sets a flag) lets the step return as usual -- each output once, not again with the next
    step (the review's probe of the first hold: every output came back twice)."""
    seen = []
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if handler == "ignore" else lambda s, f: seen.append(s))
    try:
        engine = _one_request_engine(tokenizer)
        _ctrl_c_in(engine, monkeypatch)
        first = engine.step()
        monkeypatch.undo()
        assert [(o.request_id, o.finished) for o in first] == [("a", True)]
        assert engine.step() == [] and not engine.has_unfinished_requests()
        assert seen == ([] if handler == "ignore" else [signal.SIGINT])
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_right_after_the_hold_ends_loses_no_output(tokenizer, monkeypatch):
    """The window the review found: a Ctrl-C after the step's last check but before it returned dropped its
    outputs.  The outputs now wait in the engine until the step hands them over, so a KeyboardInterrupt raised as
    the hold ends leaves them for the next step."""
    from minivllm.engine import llm_engine

    real_exit = llm_engine._CtrlCHeld.__exit__

    def exit_then_ctrl_c(self, *exc):
        real_exit(self, *exc)
        signal.raise_signal(signal.SIGINT)  # the hold is over: KeyboardInterrupt at once

    engine = _one_request_engine(tokenizer)
    monkeypatch.setattr(llm_engine._CtrlCHeld, "__exit__", exit_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    assert [(o.request_id, o.finished) for o in engine.step()] == [("a", True)]


def test_a_step_inside_a_step_puts_the_handler_back(tokenizer, monkeypatch):
    """The engine's lock is reentrant, so a step can run inside a step (a callback that steps): the handler must
    be the original again after both, or Ctrl-C is dead for the process (the review's probe: ``_hold`` left in)."""
    engine = _one_request_engine(tokenizer, max_tokens=3)
    before = signal.getsignal(signal.SIGINT)
    real, inner = engine.log_step, []

    def log_and_step_inside(batch):
        real(batch)
        if not inner:
            inner.append("stepping")
            inner.append(engine.step())

    monkeypatch.setattr(engine, "log_step", log_and_step_inside)
    engine.step()
    monkeypatch.undo()
    assert inner and signal.getsignal(signal.SIGINT) is before


def test_a_new_request_cannot_take_the_id_of_one_whose_last_output_waits(tokenizer, monkeypatch):
    """After a Ctrl-C ended the step that finished ``a``, ``a``'s final output waits for the next step; a new
    request under the same id would be handed it (the review's probe).  The id is in use until then."""
    engine = _one_request_engine(tokenizer)
    _ctrl_c_in(engine, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2), request_id="a")
    assert [(o.request_id, o.finished) for o in engine.step()] == [("a", True)]
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2), request_id="a")


def test_an_abort_from_inside_a_step_keeps_that_steps_final_output(tokenizer):
    """An abort asked from inside a step (the executor, a callback on the stepping thread) ends when the step does;
    a request that finished in that very step keeps its final output, as before the hold (the review's probe: the
    deferred abort dropped it from the outputs waiting to be returned)."""
    engine = LLMEngine(EngineConfig(num_gpu_blocks_override=40, block_size=4, max_model_len=96),
                       executor=SimulatedExecutor(vocab_size=VOCAB), tokenizer=tokenizer, eos_token_ids=set())
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, ignore_eos=True), request_id="a")
    real = engine.executor.execute

    def execute_then_abort(batch):
        sampled = real(batch)
        assert engine.abort_request("a")  # deferred: the step is under way
        return sampled

    engine.executor.execute = execute_then_abort
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outputs] == [("a", True, "length")]
    assert not engine.has_unfinished_requests()
