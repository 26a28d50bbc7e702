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

from dataclasses import dataclass, replace
from typing import Any

from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.request import Request, RequestStatus


@dataclass
class _Stream:
    """Per-request output state kept beside the request."""

    detok: IncrementalDetokenizer
    defer_text: bool = False  # final_only without stop strings: nobody reads the text before the end
    every_step: bool = True  # an output every step (cumulative, delta), not only the final one
    emitted_chars: int = 0
    undecoded: int = 0  # defer_text: tokens not detokenized yet (done once, at the end)


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._streams: dict[str, _Stream] = {}
        self._groups: dict[str, list[CompletionOutput]] = {}  # n > 1: parent id -> one slot per sample

    def add(self, samples: list[Request]) -> None:
        for req in samples:
            params = req.sampling_params
            final_only = params.output_kind == "final_only"
            self._streams[req.request_id] = _Stream(
                IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens),
                defer_text=final_only and not params.stop_strings,  # the params are frozen: decided once
                every_step=not final_only,
            )
        first = samples[0]
        if first.parent_id is not None:
            self._groups[first.parent_id] = [
                CompletionOutput(index=i, text="", token_ids=[]) for i in range(len(samples))
            ]

    def has_group(self, parent_id: str) -> bool:
        return parent_id in self._groups

    # -- step 6: emit --------------------------------------------------------
    def emit(self, grew: list[Request]) -> list[RequestOutput]:
        """Detokenize each request's new token, check stops, build its output.

        A failure here (a tokenizer that cannot decode a token, say) is that
        request's alone: it finishes with ``finish_reason == "error"`` and the
        other requests' outputs are built as usual.
        """
        outputs: list[RequestOutput] = []
        streams, eos = self._streams, self.eos_token_ids
        for req in grew:  # once per request per step: only attribute reads unless something happens
            token = req.output_token_ids[-1]
            stream = streams[req.request_id]
            params = req.sampling_params
            try:
                if stream.defer_text:
                    stream.undecoded += 1  # nobody reads the text before the end: decode it once, then
                else:
                    stream.detok.add_token(token)
                if (token in eos or token in params.stop_token_ids or params.stop_strings
                        or len(req.output_token_ids) >= req.max_tokens):  # otherwise no stop can fire
                    self._check_stop(req, token, stream)
                finished = req.status.finished
                if finished:
                    self._catch_up(req, stream)
                if stream.every_step or finished:
                    outputs.append(self._make_output(req, stream, [token]))
            except Exception as exc:  # noqa: BLE001 - isolated: reported as finish_reason "error"
                req.status, req.error = RequestStatus.FINISHED_ERROR, f"output processing failed: {exc}"
                outputs.append(self.final_output(req))
        return outputs

    @staticmethod
    def _catch_up(req: Request, stream: _Stream) -> None:
        """Detokenize the tokens a final-only request skipped, through the same incremental path."""
        pending, stream.undecoded = stream.undecoded, 0
        for token in req.output_token_ids[len(req.output_token_ids) - pending :]:
            stream.detok.add_token(token)

    def final_output(self, req: Request) -> RequestOutput:
        """The last output of a request that finished outside the normal path (rejected, failed, aborted sample)."""
        stream = self._streams.get(req.request_id)
        try:
            if stream is not None:
                self._catch_up(req, stream)
            return self._make_output(req, stream, [])
        except Exception:  # noqa: BLE001 - the stream itself is broken: report the tokens without text
            return self._make_output(req, None, [])

    def _check_stop(self, req: Request, token: int, stream: _Stream) -> None:
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif token in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif params.stop_strings and self._truncate_at_stop(req, stream):
            req.status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_token_ids) >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH

    @staticmethod
    def _truncate_at_stop(req: Request, stream: _Stream) -> bool:
        text = stream.detok.text
        params = req.sampling_params
        # only the newest characters can complete a stop string
        window = max(len(s) for s in params.stop_strings) + 16
        from_char = max(0, len(text) - window)
        for stop in params.stop_strings:
            at = text.find(stop, from_char)
            if at != -1:
                end = at + len(stop) if params.include_stop_str_in_output else at
                stream.detok.text = text[:end]
                req.stop_reason = stop
                return True
        return False

    def _make_output(self, req: Request, stream: _Stream | None, new_tokens: list[int]) -> RequestOutput:
        finished = req.status.finished
        params = req.sampling_params
        if stream is None:
            text, visible, delta = "", 0, ""
        else:
            text = stream.detok.text
            # hold back text that might be the start of a stop string until we know
            hold = 0 if finished or not params.stop_strings else max(len(s) for s in params.stop_strings) - 1
            visible = max(stream.emitted_chars, len(text) - hold)
            delta = text[stream.emitted_chars : visible]
            stream.emitted_chars = visible
        delta_kind = params.output_kind == "delta"
        completion = CompletionOutput(
            index=req.sample_index,
            text=delta if delta_kind else text[:visible],
            token_ids=list(new_tokens) if delta_kind else list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            delta_text=delta,
            delta_token_ids=new_tokens,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            token_times=req.token_times[-len(new_tokens):] if delta_kind and new_tokens else (
                [] if delta_kind else list(req.token_times)),
            finished_time=req.finished_time,
            num_preemptions=req.num_preemptions,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=metrics,
            num_cached_tokens=req.num_cached_tokens,
            retry_after_s=req.retry_after_s,
        )

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
                completions[req.sample_index] = replace(done, text="", token_ids=[], delta_text="", delta_token_ids=[])
            else:
                completions[req.sample_index] = replace(done, delta_text="", delta_token_ids=[])
            changed.setdefault(req.parent_id, {})[req.sample_index] = done
            result[req.parent_id] = out  # the newest sample's output carries the group's metrics
        for parent_id, fresh in changed.items():
            completions = self._groups[parent_id]
            last = result[parent_id]
            finished = all(c.finish_reason is not None for c in completions)
            result[parent_id] = replace(
                last,
                request_id=parent_id,
                outputs=[fresh.get(i, c) for i, c in enumerate(completions)],
                finished=finished,
            )
            if finished:
                del self._groups[parent_id]
        return list(result.values())

    def forget(self, req: Request) -> None:
        self._streams.pop(req.request_id, None)

    def forget_group(self, parent_id: str) -> None:
        self._groups.pop(parent_id, None)
