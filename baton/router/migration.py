"""Mid-stream migration: a stream whose engine fails after its first byte goes on, on another
engine, from the last token the client got (NVIDIA Dynamo's `--migration-limit`).

Every migratable stream (streamed, one prompt, n=1) is sent to its engine with vLLM's
`return_token_ids`, so each event carries the ids of the tokens whose text it holds (an engine
sends an event for every token then, even one whose text it holds back). `StreamLog` frames
the engine's events, keeps those ids (as the bytes they came in: they are parsed only if the
stream migrates), takes the fields out of the events when the client did not ask for them, and
notes how the stream ended: `data: [DONE]`, an error event (a draining engine says it is going
away with one), or neither (the connection broke).

On a failure `Migrator.resume` sends the client's request again to another engine that serves
the model, with `resume_token_ids` (the ids so far): that engine computes prompt + those tokens
and continues as if it had sampled them (remaining `max_tokens` and `min_tokens`, penalties,
grammar state, held-back text and stop strings across the cut, usage of the whole answer; a
seeded request continues from a seed derived from its seed and the position, see
`baton.engine.sampling_params`), sending only what the client has not had. Up to
`migration_limit` times per request; each try counts in `baton:router_migrations_total`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING

from baton.errors import APIError
from baton.router.engines import EngineState

if TYPE_CHECKING:
    from baton.roles import Role
    from baton.router.policies import Policy
    from baton.router.proxy import Answer
    from baton.router.router import Routed, Router

logger = logging.getLogger(__name__)

RESUME_TOKEN_IDS = "resume_token_ids"
_CHUNK = b'data: {"id":'  # how every chunk event starts
_COMPACT = b'data: {"id":"'  # ... written without spaces, as pydantic writes (Baton's, vLLM's)
_DONE = b"data: [DONE]"
_TOKEN_IDS = b'"token_ids":['
_PROMPT_TOKEN_IDS = b',"prompt_token_ids":['
_FINISHED = b'"finish_reason":"'


class StreamLog:
    """One engine stream's events as they pass: the token ids sent, and how it ended."""

    def __init__(self, strip_token_ids: bool) -> None:
        self._strip = strip_token_ids  # the client did not ask for token ids
        self._partial = b""  # an event not yet complete
        self._ids: list[bytes] = []  # each event's `1,2,3`
        self.done = False  # `data: [DONE]` went out
        self.finished = False  # a finish_reason went out: the answer is complete
        self.error: str | None = None  # the engine's error event, which was not sent on
        self.annotation = b""  # added to the event with the finish_reason (migrations)

    def feed(self, piece: bytes) -> bytes:
        """The complete events of `piece` (and what came before it) as the client gets them;
        nothing more once an error event came."""
        if self.error is not None:
            return b""
        data = self._partial + piece if self._partial else piece
        end = data.rfind(b"\n\n")
        if end < 0:
            self._partial = data
            return b""
        self._partial = data[end + 2 :]
        out = []
        for event in data[:end].split(b"\n\n"):
            event = self._event(event)
            if self.error is not None:
                break
            out.append(event + b"\n\n")
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_CHUNK):
            if event == _DONE:
                self.done = True
            elif event.startswith(b"data: {"):  # an error event (a chunk starts with its id)
                self.error = _server_error(event[6:])
            return event
        if not event.startswith(_COMPACT):
            return self._parsed(event)
        # Found in the bytes: in JSON text a quote inside a string is escaped, so these
        # patterns are keys, and an id list holds only digits and commas.
        i = event.find(_TOKEN_IDS)
        if i >= 0:
            j = event.index(b"]", i)
            ids = event[i + len(_TOKEN_IDS) : j]
            if ids:
                self._ids.append(ids)
            if self._strip:  # with its comma: never the first field of a choice
                event = event[: i - 1] + event[j + 1 :]
        if self._strip and (k := event.find(_PROMPT_TOKEN_IDS)) >= 0:
            event = event[:k] + event[event.index(b"]", k) + 1 :]
        if _FINISHED in event:
            self.finished = True
            if self.annotation:
                event = event[:-1] + self.annotation + b"}"
        return event

    def _parsed(self, event: bytes) -> bytes:
        """`_event` for a chunk in another JSON layout: parsed, and written again if changed."""
        chunk = json.loads(event[6:])
        changed = False
        for choice in chunk.get("choices") or ():
            ids = choice.pop("token_ids", None) if self._strip else choice.get("token_ids")
            changed |= self._strip and ids is not None
            if ids:
                self._ids.append(",".join(map(str, ids)).encode())
            if choice.get("finish_reason") is not None:
                self.finished = True
                if self.annotation:
                    chunk.update(json.loads(b"{" + self.annotation[1:] + b"}"))
                    changed = True
            if self._strip and choice.pop("prompt_token_ids", None) is not None:
                changed = True
        if self._strip and chunk.pop("prompt_token_ids", None) is not None:
            changed = True
        return b"data: " + json.dumps(chunk).encode() if changed else event

    def restart(self) -> None:
        """For the next engine's stream: the last one's unfinished event and error are gone."""
        self._partial = b""
        self.error = None
        self.done = False

    def token_ids(self) -> list[int]:
        """Every token id the client has been sent, in order."""
        return [int(t) for ids in self._ids for t in ids.split(b",")]


class Migrator:
    """Re-issues one stream on other engines when its engine fails, up to the limit."""

    def __init__(
        self, router: Router, routed: Routed, roles: Collection[Role], policy: Policy
    ) -> None:
        self.router = router
        self.routed = routed
        self.roles = roles
        self.policy = policy
        self.limit = router.config.migration_limit
        self.count = 0
        self.failed: set[str] = set()  # engines this request failed on

    async def resume(self, failed: EngineState, log: StreamLog, why: str) -> Answer:
        """The answer of another engine continuing the stream after `log`'s tokens; APIError
        (sent to the client as an error event) when the limit is reached or none can."""
        router, routed = self.router, self.routed
        self.failed.add(failed.url)
        request_id = routed.headers.get("x-request-id")
        if self.count >= self.limit:
            router.metrics.migration("limit_reached")
            logger.warning("request %s: stream from %s failed (%s); migration limit %d reached",
                           request_id, failed.url, why, self.limit)  # fmt: skip
            raise APIError(502, f"the engine's stream broke ({why}) after {self.count} migrations")
        self.count += 1
        ids = log.token_ids()
        body = {**routed.body, RESUME_TOKEN_IDS: ids}

        def pick(tried: set[str]) -> EngineState | None:
            return router.choose(routed, self.roles, self.policy, tried | self.failed)

        try:
            answer = await router.upstream.send(
                routed.route,
                pick,
                json.dumps(body).encode(),
                routed.headers,
                stream=True,
                none_available=f"no other healthy engine serves the model `{routed.model}`",
            )
        except APIError as e:
            router.metrics.migration("failed")
            logger.warning("request %s: migration %d from %s failed: %s",
                           request_id, self.count, failed.url, e.message)  # fmt: skip
            raise APIError(502, f"the engine's stream broke ({why}); {e.message}") from None
        if answer.stream is None:  # the new engine refused the request
            router.metrics.migration("failed")
            message = error_message(answer.body)
            raise APIError(502, f"the engine's stream broke ({why}); {message}")
        router.metrics.migration("resumed")
        log.restart()
        log.annotation = b',"baton_migrations":%d' % self.count
        logger.info("request %s: stream migrated from %s (%s) to %s after %d tokens (%d of %d)",
                    request_id, failed.url, why, answer.engine.url, len(ids), self.count,
                    self.limit)  # fmt: skip
        return answer


def _server_error(body: bytes) -> str | None:
    """The message of an error event that another engine may not repeat (a 5xx: the engine
    failed, or is going away); None for the client's own fault (a 4xx), which is sent on."""
    try:
        error = json.loads(body).get("error")
        code = error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
    if isinstance(code, int) and code < 500:
        return None
    return error_message(body)


def error_message(body: bytes | None) -> str:
    """The `error.message` of an OpenAI-shaped error body, else the body's start."""
    if not body:
        return ""
    try:
        error = json.loads(body).get("error", {})
        return str(error.get("message", "")) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
