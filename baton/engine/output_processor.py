"""Turns engine-core outputs into `RequestOutput`s: detokenizes, finds stop strings, merges the
n samples of one prompt. Runs beside the client, never in the busy loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baton.engine.detokenizer import IncrementalDetokenizer
from baton.engine.outputs import CompletionOutput, Logprob, RequestOutput
from baton.engine.protocol import EngineCoreOutput
from baton.engine.sampling_params import SamplingParams
from baton.tokenizer import Tokenizer


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Parent:
    # The request's fields as its next snapshot carries them, except `outputs` and `finished`,
    # which `_make_output` fills in from the samples.
    output: RequestOutput
    samples: dict[str, _Sample] = field(default_factory=dict)

    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, _Parent] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        child_ids: list[str],
        params: SamplingParams,
        resume_token_ids: list[int] | None = None,
    ) -> None:
        """Starts following a request. A resumed answer (`resume_token_ids`: the output another
        engine produced, one sample) starts with those tokens: its text is theirs, stop strings
        that end past them are found wherever they start, its token list (what usage counts)
        holds them, and its logprob list has an empty entry for each, so that positions line
        up (their logprobs were sent by that engine)."""
        resumed = resume_token_ids or []
        parent = _Parent(RequestOutput(request_id, prompt, prompt_token_ids))
        for index, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                params.stop,
                params.skip_special_tokens,
                params.min_tokens,
                prompt_token_ids,
                params.include_stop_str_in_output,
            )
            detok.resume(resumed)
            want_logprobs = params.logprobs is not None
            parent.samples[child_id] = _Sample(
                index,
                detok,
                [{} for _ in resumed] if want_logprobs else None,
                0.0 if want_logprobs else None,
            )
            self._child_to_parent[child_id] = parent
        self._parents[request_id] = parent

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns a snapshot of every request that changed (`.finished` once all its samples
        are done) and the child ids to abort in the engine core (those that hit a stop string).

        Snapshots share their token and logprob lists with the processor: read them before the
        next call (a stream sends the part past what it sent last time).
        """
        to_abort: list[str] = []
        touched: dict[str, _Parent] = {}
        for out in outputs:
            parent = self._child_to_parent.get(out.request_id)
            if parent is None:
                continue
            sample = parent.samples[out.request_id]
            req = parent.output
            req.num_cached_tokens = max(req.num_cached_tokens, out.num_cached_tokens)
            req.num_external_tokens = max(req.num_external_tokens, out.num_external_tokens)
            if out.queue_time is not None and req.queue_time is None:
                req.queue_time = out.queue_time
            if out.prefill_time is not None and req.prefill_time is None:
                req.prefill_time = out.prefill_time
            if out.prompt_logprobs is not None and req.prompt_logprobs is None:
                # The request's first output carries them (n > 1: any child's, all equal).
                # Nothing predicts the first prompt token, so its entry is None, as in vLLM.
                entries = out.prompt_logprobs
                req.prompt_logprobs = [None, *(self._logprob_dict(e) for e in entries)]
            if out.new_logprobs and sample.logprobs is not None:
                for entry in out.new_logprobs:
                    sample.logprobs.append(self._logprob_dict(entry))
                    sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + (
                        entry.logprobs[0]
                    )
            # "stop" from the core is an EOS or stop token id (stop strings are found here).
            stop = sample.detok.update(
                out.new_token_ids, stop_terminated=out.finish_reason == "stop"
            )
            if stop is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                sample.detok.flush()
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
                if out.kv_transfer_params is not None:
                    req.kv_transfer_params = out.kv_transfer_params.to_json()
                if out.error is not None:
                    req.error, req.error_status = out.error, out.error_status
            touched[req.request_id] = parent
        updates = []
        for parent in touched.values():
            updates.append(self._make_output(parent))
            if parent.finished():
                del self._parents[parent.output.request_id]
                for child_id in parent.samples:
                    del self._child_to_parent[child_id]
        return updates, to_abort

    def abort(self, request_id: str) -> list[str]:
        """Forgets a request; returns its child ids so the caller aborts them in the engine."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for child_id in parent.samples:
            self._child_to_parent.pop(child_id, None)
        return list(parent.samples)

    def _logprob_dict(self, entry: Any) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for i, (token, lp) in enumerate(zip(entry.token_ids, entry.logprobs, strict=True)):
            if token in result:
                continue
            rank = entry.sampled_rank if i == 0 else i
            result[token] = Logprob(lp, rank, self.tokenizer.decode([token]))
        return result

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detok.text,
                token_ids=s.detok.token_ids,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in parent.samples.values()  # added in index order (`add_request`)
        ]
        # A copy of the template's fields: `dataclasses.replace` would run the constructor
        # over every field, a measurable part of a token's cost in the API process.
        snapshot = object.__new__(RequestOutput)
        snapshot.__dict__.update(parent.output.__dict__)
        snapshot.outputs, snapshot.finished = outputs, parent.finished()
        return snapshot
