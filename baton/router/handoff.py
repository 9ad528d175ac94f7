"""The prefill→decode hand-off of a disaggregated model, and when to skip it.

Step 1 sends the request to a prefill engine with `max_tokens=1`, `stream: false` and
`kv_transfer_params={"do_remote_decode": true}`, less the fields that only constrain sampling
(`CONSTRAINT_FIELDS`: the decode engine samples every token the client sees, and the prefill's
one token is discarded, so a grammar compiled there would be work thrown away) but with every
field that shapes the prompt (messages, tools, chat_template_kwargs); its answer carries the
`kv_transfer_params` that say where the prompt's KV blocks wait (engine id, host, port,
request id, block ids, lease). Step 2 sends the original request to a decode engine with
those params plus `"do_remote_prefill": true`, and the decode engine's answer (streamed or
whole) goes to the client.

The decode engine is chosen first, because whether to do step 1 at all depends on it:
- a batch of prompts is served by the decode engine alone (one set of params cannot describe
  several prompts): `decode_only_fallback`;
- so is a request that wants its prompt's logprobs (`prompt_logprobs`, or `echo` with
  `logprobs` on completions): only the engine that computes the prompt sees its logits, and a
  decode engine that reads the KV never does: `decode_only_fallback`;
- a prompt under `disagg_min_tokens` skips step 1: `skipped_short`; counted exactly when the
  router has the prompt's token ids and the decode engine's KV events, where what counts is
  the part the decode engine does not hold yet; estimated from characters otherwise;
- a prompt whose blocks the decode engine mostly holds already skips step 1: `skipped_cached`
  (matched tokens from its KV events, or the approximate index's matched blocks);
- no prefill engine available, none that can hand KV to the decode engine (unequal
  tensor_parallel_size or compatibility fingerprint, each where both engines say; a decode
  engine that can pair is chosen first when there is one), or every prefill attempt failed:
  `on_no_prefill` decides,
  `decode` serves it on the decode engine alone (`decode_only_fallback`), `fail` answers 503
  (`failed`);
- otherwise `disaggregated`. Every request counts exactly one outcome in
  `baton:router_disagg_decisions_total`: the router never falls back silently.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from baton import tracing
from baton.errors import APIError
from baton.kv_transfer.params import DO_REMOTE_DECODE, DO_REMOTE_PREFILL
from baton.router.engines import DECODE_ROLES, PREFILL_ROLES
from baton.router.metrics import DisaggOutcome

if TYPE_CHECKING:
    from baton.router.engines import EngineState
    from baton.router.router import Routed, Router

logger = logging.getLogger(__name__)


# What only constrains the sampled tokens (structured outputs and logits masks): dropped from
# step 1. `tool_choice` stays: with `none` a template may leave the tools out of the prompt.
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structural_tag",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)


def wants_prompt_logprobs(route: str, body: dict[str, Any]) -> bool:
    """The request asks for its prompt's logprobs, which only the engine that computes the
    prompt has (vLLM's `prompt_logprobs`, which completions' `echo` with `logprobs` implies)."""
    if body.get("prompt_logprobs") is not None:
        return True
    return (
        route == "/v1/completions" and bool(body.get("echo")) and body.get("logprobs") is not None
    )


def prefill_body(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """Step 1's request: the original, computing the prompt and one token, kept for a reader."""
    out = {k: v for k, v in body.items() if k not in CONSTRAINT_FIELDS}
    out.update(max_tokens=1, stream=False, n=1, kv_transfer_params={DO_REMOTE_DECODE: True})
    if route == "/v1/chat/completions":
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    if out.get("min_tokens"):
        out["min_tokens"] = 0  # min_tokens > max_tokens would be a 400
    if out.get("tools"):
        # The tools still render into the prompt (whatever the choice), but no forced call's
        # grammar is compiled, and "auto" needs no tool parser on the prefill engine.
        out["tool_choice"] = "none"
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Step 2's request: the original, reading its prompt's KV blocks from the prefill engine."""
    return {**body, "kv_transfer_params": {**params, DO_REMOTE_PREFILL: True}}


class Handoff:
    """Serves the requests of disaggregated models for one `Router`."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.config = router.config

    async def serve(self, routed: Routed) -> Response:
        router, config = self.router, self.config
        prefills = router.engines.available(routed.model, PREFILL_ROLES)
        # A decode engine no prefill engine can hand KV to (a rollout's new engines up before
        # their prefill counterparts) serves only when no decode engine can pair.
        decode = router.choose(
            routed, DECODE_ROLES, router.decode_policy, prefer_pairs_with=prefills
        )
        if decode is None:
            self._count("failed", routed, "no decode engine")
            raise APIError(503, f"no healthy decode engine serves the model `{routed.model}`")
        prompt = routed.prompt
        # A hand-off moves one prompt's KV for one sample (the engines refuse anything else):
        # a batch of prompts, or several samples of one, is computed on the decode engine.
        if prompt.num_prompts > 1:
            return await self._decode(routed, decode, "decode_only_fallback", "a batch of prompts")
        if isinstance(n := routed.body.get("n"), int) and n > 1:
            return await self._decode(routed, decode, "decode_only_fallback", f"n={n}")
        if wants_prompt_logprobs(routed.route, routed.body):
            return await self._decode(routed, decode, "decode_only_fallback", "prompt logprobs")
        cached = router.view.cached_tokens(decode.url, prompt)
        uncached = prompt.estimated_tokens(config.chars_per_token) - (cached or 0)
        if uncached < config.disagg_min_tokens:
            why = "short prompt" if not cached else f"{uncached} tokens not cached on decode"
            return await self._decode(routed, decode, "skipped_short", why)
        fraction = router.view.fractions((decode.url,), prompt)[decode.url]
        if fraction >= config.disagg_cached_fraction:
            return await self._decode(routed, decode, "skipped_cached", "cached on decode")
        if not prefills:
            return await self._no_prefill(
                routed, decode, f"no healthy prefill engine serves the model `{routed.model}`"
            )
        if not any(p.can_pair_with(decode) for p in prefills):
            return await self._no_prefill(routed, decode, self._unpaired(routed, decode, prefills))
        if decode.warned_unpaired:
            decode.warned_unpaired = False
            logger.info("decode engine %s has a compatible prefill engine again", decode.url)
        try:
            answer = await router.upstream.send(
                routed.route,
                router.picker(routed, PREFILL_ROLES, router.prefill_policy, pair=decode),
                json.dumps(prefill_body(routed.route, routed.body)).encode(),
                routed.headers,
                stream=False,
                none_available=f"no healthy prefill engine serves the model `{routed.model}`",
            )
        except APIError as e:
            if e.status == 503:
                return await self._no_prefill(routed, decode, f"prefill failed: {e.message}")
            self._count("failed", routed, e.message)
            raise
        if answer.status != 200:  # the prompt itself is bad: the client must hear why
            self._count("failed", routed, f"prefill answered {answer.status}")
            return router.upstream.response(answer, routed.route, routed.started)
        tracing.current().set(tracing.SpanAttributes.PREFILL_ENGINE, answer.engine.url)
        params = _kv_transfer_params(answer.body)
        if params is None:
            logger.warning(
                "prefill engine %s answered without kv_transfer_params; is it a prefill engine?",
                answer.engine.url,
            )
            return await self._decode(
                routed, decode, "decode_only_fallback", "prefill answer without params"
            )
        self._count("disaggregated", routed, answer.engine.url)
        return await router.forward(
            routed,
            DECODE_ROLES,
            router.decode_policy,
            json.dumps(decode_body(routed.body, params)).encode(),
            none_available=f"no healthy decode engine serves the model `{routed.model}`",
            first=decode,
            pair=answer.engine,  # a retry goes to a decode engine that can read these blocks
            extra_headers={"x-baton-prefill-engine": answer.engine.url},
        )

    def _unpaired(self, routed: Routed, decode: EngineState, prefills: list[EngineState]) -> str:
        """Why no prefill engine can hand KV to `decode` (for the client and the 503); the
        first time for this decode engine, a warning with what differs, for the operator."""
        why = (
            f"no healthy prefill engine of the model `{routed.model}` has the decode engine's "
            f"tensor_parallel_size {decode.tensor_parallel_size} and fingerprint "
            f"{decode.fingerprint}: KV blocks move only between engines that agree"
        )
        if not decode.warned_unpaired:
            decode.warned_unpaired = True
            theirs = sorted({f"{p.fingerprint} (tp {p.tensor_parallel_size})" for p in prefills})
            differ = sorted(
                {k for p in prefills for k in {*p.compatibility, *decode.compatibility}
                 if p.compatibility.get(k) != decode.compatibility.get(k)}
            )  # fmt: skip
            logger.warning(
                "model %s: no compatible prefill engine for decode engine %s (fingerprint %s, "
                "tp %s); prefill engines have %s%s; its requests follow --on-no-prefill=%s",
                routed.model, decode.url, decode.fingerprint, decode.tensor_parallel_size,
                ", ".join(theirs), f", differing in {', '.join(differ)}" if differ else "",
                self.config.on_no_prefill,
            )  # fmt: skip
        return why

    async def _no_prefill(self, routed: Routed, decode: EngineState, why: str) -> Response:
        if self.config.on_no_prefill == "decode":
            return await self._decode(routed, decode, "decode_only_fallback", why)
        self._count("failed", routed, why)
        raise APIError(503, f"{why} (the router runs with --on-no-prefill=fail)")

    async def _decode(
        self, routed: Routed, decode: EngineState, outcome: DisaggOutcome, why: str
    ) -> Response:
        """The request on the decode engine alone, which computes the prompt itself."""
        self._count(outcome, routed, why)
        return await self.router.forward(
            routed,
            DECODE_ROLES,
            self.router.decode_policy,
            routed.raw,
            none_available=f"no healthy decode engine serves the model `{routed.model}`",
            first=decode,
        )

    def _count(self, outcome: DisaggOutcome, routed: Routed, why: str) -> None:
        self.router.metrics.disagg_decision(outcome)
        tracing.current().set(tracing.SpanAttributes.DISAGG_OUTCOME, outcome)
        if outcome != "disaggregated":
            logger.debug("%s %s: %s (%s)", routed.route, routed.model, outcome, why)


def _kv_transfer_params(body: bytes | None) -> dict[str, Any] | None:
    try:
        params = json.loads(body or b"").get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and params else None
