"""Output processing: steps 6 and 7 of the loop for the caller's side.

For every request that gained a token this step: detokenize incrementally
(never half a UTF-8 character), check the stop conditions (EOS, stop token
ids, stop strings, ``max_tokens``), hold back text that might be the start of
a stop string, and build the ``RequestOutput`` a streaming client reads.
``n > 1`` samples are folded back into one output per parent (fan-in).

The engine owns the requests and their blocks; this class owns only the
per-request *output* state (:class:`_Stream`) and never frees anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.interfaces import Tokenizer
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.request import Request, RequestStatus


@dataclass(slots=True)
class _Stream:
    """Per-request output state kept beside the request.

    The stop settings are copied out of the (frozen) sampling parameters once, at
    ``add``: the emit loop reads them for every request on every step.  ``stop_ids``
    folds the two token tests into one set lookup.
    """

    detok: IncrementalDetokenizer
    stop_ids: frozenset  # token ids that can stop it: SamplingParams.stop_token_ids, and EOS unless ignore_eos
    stop_strings: tuple  # SamplingParams.stop_strings
    delta: bool  # output_kind == "delta"
    stop_text: bool = False  # include_stop_str_in_output: a stop token's text (like a stop string) is kept
    defer_text: bool = False  # final_only without stop strings: nobody reads the text before the end
    every_step: bool = True  # an output every step (cumulative, delta), not only the final one
    emitted_chars: int = 0
    stop_checked: int = 0  # characters of text already searched for stop strings
    decoded: int = 0  # defer_text: output tokens detokenized so far (all of them, once, at the end)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int],
                 group_samples: Mapping[str, list[Request]]) -> None:
        """``group_samples``: parent id -> the samples of an ``n > 1`` request, the engine's own table, read here
        and changed only there (one record of who belongs to a group, not two kept in step by hand)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._streams: dict[str, _Stream] = {}
        self._groups: dict[str, list[CompletionOutput]] = {}  # n > 1: parent id -> one slot per sample
        self._group_samples = group_samples

    def add(self, samples: list[Request]) -> None:
        # one set per request, shared by its samples (they share their params): a set per sample would make n=128
        # samples of a request listing 1M stop ids build 128 sets on the engine thread, a 4 s stall for every stream
        sets: dict[int, frozenset] = {}
        for req in samples:
            params = req.sampling_params
            final_only = params.output_kind == "final_only"
            stop_ids = sets.get(id(params))
            if stop_ids is None:
                stop_ids = frozenset(params.stop_token_ids)
                if not params.ignore_eos:
                    stop_ids |= self.eos_token_ids
                sets[id(params)] = stop_ids
            self._streams[req.request_id] = _Stream(
                IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens),
                stop_ids, params.stop_strings, params.output_kind == "delta", params.include_stop_str_in_output,
                defer_text=final_only and not params.stop_strings,  # the params are frozen: decided once
                every_step=not final_only,
            )
        first = samples[0]
        if first.parent_id is not None:
            self._groups[first.parent_id] = [
                CompletionOutput(index=i, text="", token_ids=[]) for i in range(len(samples))
            ]

    # -- step 6: emit --------------------------------------------------------
    def emit(self, grew: list[Request]) -> list[RequestOutput]:
        """Detokenize each request's new token, check stops, build its output.

        A failure here (a tokenizer that cannot decode a token, say) is that
        request's alone: it finishes with ``finish_reason == "error"`` and the
        other requests' outputs are built as usual.
        """
        outputs: list[RequestOutput] = []
        streams = self._streams
        for req in grew:  # once per request per step: only attribute reads unless something happens
            tokens = req.output_token_ids
            token = tokens[-1]
            stream = streams[req.request_id]
            if stream.defer_text and token not in stream.stop_ids and len(tokens) < req.max_tokens:
                continue  # final_only, no stop strings, nothing stops: nothing to decode, check or report
            try:
                stops_here = token in stream.stop_ids
                # (a deferred stream is detokenized once, at its end: _catch_up).  The token that stops a
                # request stays in its token ids but not in its text, as a matched stop string does not.
                if not stream.defer_text and (stream.stop_text or not stops_here):
                    stream.detok.add_token(token)
                if (stops_here or stream.stop_strings
                        or len(tokens) >= req.max_tokens):  # otherwise no stop can fire
                    self._check_stop(req, token, stream)
                finished = req.status.finished
                if finished:
                    self._catch_up(req, stream)
                    stream.detok.flush()  # (after a stop string nothing is held: it was found in released text)
                if stream.every_step or finished:
                    outputs.append(self._make_output(req, stream, [token]))
            except Exception as exc:  # noqa: BLE001 - isolated: reported as finish_reason "error"
                req.status, req.error = RequestStatus.FINISHED_ERROR, f"output processing failed: {exc}"
                outputs.append(self.final_output(req, [token]))  # the token is the request's: its delta reports it
        return outputs

    @staticmethod
    def _catch_up(req: Request, stream: _Stream) -> None:
        """Detokenize the tokens a final-only request skipped, through the same incremental path."""
        if not stream.defer_text:
            return  # detokenized token by token in emit
        start, stream.decoded = stream.decoded, len(req.output_token_ids)
        tokens = req.output_token_ids[start:]
        if tokens and req.status is RequestStatus.FINISHED_STOPPED and not stream.stop_text:
            tokens = tokens[:-1]  # (no stop strings when deferred: it stopped on this token) -- its text is dropped
        for token in tokens:
            stream.detok.add_token(token)

    def final_output(self, req: Request, new_tokens: list[int] | None = None) -> RequestOutput:
        """The last output of a request that finished outside the normal path (rejected, failed, aborted sample);
        ``new_tokens``: what this step added to it (a token whose output processing failed), if anything."""
        stream = self._streams.get(req.request_id)
        new_tokens = new_tokens or []
        try:
            if stream is not None:
                self._catch_up(req, stream)
            return self._make_output(req, stream, new_tokens)
        except Exception:  # noqa: BLE001 - the stream itself is broken: report the tokens without text
            return self._make_output(req, None, new_tokens)

    def _check_stop(self, req: Request, token: int, stream: _Stream) -> None:
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif token in stream.stop_ids:  # a set: a request may list thousands of ids (EOS was the branch above)
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif params.stop_strings and self._truncate_at_stop(req, stream):
            req.status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_token_ids) >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH

    @staticmethod
    def _truncate_at_stop(req: Request, stream: _Stream) -> bool:
        text = stream.detok.text
        params = req.sampling_params
        # Only text added since the last search can complete a stop string, plus the tail of the old text a
        # stop could start in.  (One token can add many characters: a run of 24 spaces is one token.)
        longest = max(len(s) for s in params.stop_strings)
        from_char = max(0, min(stream.stop_checked, len(text)) - longest + 1)
        stream.stop_checked = len(text)
        found = [(at, i, stop) for i, stop in enumerate(params.stop_strings) if (at := text.find(stop, from_char)) != -1]
        if not found:
            return False
        at, _, stop = min(found)  # the earliest match in the text, not the first in the list
        end = at + len(stop) if params.include_stop_str_in_output else at
        stream.detok.text = text[:end]
        req.stop_reason = stop
        return True

    def _make_output(self, req: Request, stream: _Stream | None, new_tokens: list[int]) -> RequestOutput:
        """The output of ``req`` after this step.  Built for every request on every step of a streaming
        (``delta``) run, so the three objects are built with positional arguments (half the cost of keywords)."""
        status = req.status
        finished = status.finished
        if stream is None:
            text, visible, delta, delta_kind = "", 0, "", req.sampling_params.output_kind == "delta"
        else:
            text = stream.detok.text
            # hold back text that might be the start of a stop string until we know
            hold = 0 if finished or not stream.stop_strings else max(len(s) for s in stream.stop_strings) - 1
            emitted, visible = stream.emitted_chars, len(text) - hold
            if visible > emitted:
                delta = text[emitted:visible]
                stream.emitted_chars = visible
            else:  # nothing new to show (no tokenizer, a token ending mid-character, or held back)
                delta, visible = "", emitted
            delta_kind = stream.delta
        if delta_kind:  # only this step's tokens (and their times)
            times = req.token_times[-len(new_tokens):] if new_tokens else []
            text_out, token_ids, token_times = delta, list(new_tokens), times
        else:
            text_out, token_ids, token_times = text[:visible], list(req.output_token_ids), list(req.token_times)
        # fields in declaration order: see minivllm.outputs (the completion's token times are the metrics' list:
        # one sample's own, and no second copy per request per step)
        completion = CompletionOutput(req.sample_index, text_out, token_ids, status.value if finished else None,
                                      req.stop_reason, delta, new_tokens, token_times)
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time, token_times,
                                 req.finished_time, req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished, metrics,
                             req.num_cached_tokens, req.retry_after_s, req.error)

    # -- step 7: finish (the caller's side) -----------------------------------
    def fold(self, outputs: list[tuple[Request, RequestOutput]]) -> list[RequestOutput]:
        """One output per id the caller knows: ``n > 1`` samples folded into their parent's output.

        A group's output lists every sample; only the samples that changed in
        this step carry deltas, so a streaming client never sees a finished
        sample's last delta twice.
        """
        result: dict[str, RequestOutput] = {}
        changed: dict[str, dict[int, CompletionOutput]] = {}
        for req, out in outputs:
            if req.parent_id is None:
                result[out.request_id] = out
                continue
            completions = self._groups.get(req.parent_id)
            if completions is None:
                continue  # the whole group was aborted
            done = out.outputs[0]
            if req.sampling_params.output_kind == "delta":  # a delta is reported once, then only its end
                completions[req.sample_index] = replace(done, text="", token_ids=[], delta_text="", delta_token_ids=[],
                                                        token_times=[])
            else:
                completions[req.sample_index] = replace(done, delta_text="", delta_token_ids=[])
            changed.setdefault(req.parent_id, {})[req.sample_index] = done
            held = result.get(req.parent_id)
            if held is None or done.delta_token_ids and (
                    not held.outputs[0].delta_token_ids
                    or len(out.metrics.token_times) > len(held.metrics.token_times)):
                # the group's metrics: those of a sample that got a token in this step, if any did, so the
                # last token time is this step's -- the one with the most token times (a caller reading the
                # group's metrics as the request's finds its longest sample's).  Each sample's own times are its
                # completion's (a preempted sample's are not the carrier's: EngineMetrics reads those).  With
                # delta output every such sample holds one time, the step's one clock reading, so the first
                # carries; the last would give the same times, and the same finish: the group ends in this step
                # only if every sample with a token here ended in it, at that same reading.
                result[req.parent_id] = out
        for parent_id, fresh in changed.items():
            completions = self._groups[parent_id]
            last = result[parent_id]
            finished = all(c.finish_reason is not None for c in completions)
            # A group's output carries one sample's metrics each step, but the request (what a client and
            # /metrics see) was first scheduled, and got its first token, when its earliest sample did; and it
            # was preempted as often as all its samples were (the engine's counters count each sample's), not
            # as often as the one whose metrics it carries -- often 0 while another sample was pushed out.
            samples = self._group_samples[parent_id]
            scheduled = _earliest(r.first_scheduled_time for r in samples)
            first_token = _earliest(r.first_token_time for r in samples)
            result[parent_id] = replace(
                last,
                request_id=parent_id,
                outputs=[fresh.get(i, c) for i, c in enumerate(completions)],
                finished=finished,
                # ... and it ends with its last sample: until then it has no finished time, whichever sample's
                # metrics the output carries (one that stopped in this step has its own)
                metrics=replace(last.metrics, first_scheduled_time=scheduled, first_token_time=first_token,
                                finished_time=last.metrics.finished_time if finished else None,
                                num_preemptions=sum(r.num_preemptions for r in samples)),
                error=next((r.error for r in samples if r.error is not None), None),  # any failed sample's why
                # The prompt counts once (usage.prompt_tokens), so its cached part is what the group's first lookup
                # found: its leader's, which every sample forked from it inherits.  A sample admitted after its
                # leader left looks the cache up itself and finds the prompt blocks its own leader computed; that
                # count is the engine's hit accounting, not the request's, and taking it made the answer depend on
                # which sample carried the output (8 cached tokens on a cold cache with one seat, 0 with two).
                # vLLM v1 differs here, on purpose not followed: its n > 1 children are separate requests, each
                # with its own lookup, and the parent's output carries the count of the child that produced it
                # (final-only: the last child to finish; its server's streamed usage reads the first output's),
                # so the count moves within one stream, differs streamed and not, and counts, for later children,
                # blocks the request's own first child computed.  The leader's count also holds
                # when the cache loses part of the prefix before a later sample looks (tests/test_group_usage).
                num_cached_tokens=next((r.num_cached_tokens for r in samples if r.prefix_lookup_recorded), 0),
            )
            if finished:
                del self._groups[parent_id]  # (the engine lets the group's samples go when it reads this output)
        return list(result.values())

    def forget(self, req: Request) -> None:
        """Drop ``req``'s output state once the engine lets the request go (finished or aborted): a stream holds
        a detokenizer and its text, which would otherwise live as long as the engine."""
        self._streams.pop(req.request_id, None)

    def forget_group(self, parent_id: str) -> None:
        """Drop an ``n > 1`` group's slots when the caller aborts the whole group: :meth:`fold` frees them only
        once every sample has finished, which an aborted group's samples never report."""
        self._groups.pop(parent_id, None)


def _earliest(times) -> float | None:
    """The first of some times, ``None`` if none is known yet."""
    return min((t for t in times if t is not None), default=None)
