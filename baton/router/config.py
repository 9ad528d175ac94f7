"""The router's settings: one frozen dataclass, validated on construction, built by `cli`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from baton.tracing import check_endpoint

PolicyName = Literal["round-robin", "least-load", "prefix-aware"]
POLICIES: tuple[PolicyName, ...] = ("round-robin", "least-load", "prefix-aware")
OnNoPrefill = Literal["fail", "decode"]
PrefixIndexMode = Literal["events", "approximate"]
CacheSaltFrom = Literal["client", "api-key", "header"]


@dataclass(frozen=True)
class RouterConfig:
    """How the router picks engines, hands requests off, checks health and times out."""

    # -- policies, per role ("both" engines use decode_policy) --
    prefill_policy: PolicyName = "prefix-aware"
    decode_policy: PolicyName = "prefix-aware"
    # prefix-aware: a full prefix match is worth this much extra load on an engine, measured
    # relative to the least loaded candidate (see `policies.PrefixAware`)
    prefix_load_weight: float = 1.0
    # Characters per approximate prefix block (the router does not tokenize); about one
    # 16-token engine block of English text.
    prefix_block_chars: int = 64
    prefix_index_blocks: int = 1 << 16  # approximate blocks remembered per engine (LRU)
    # events: follow the KV events of engines that publish them (exact; the approximate index
    # for the others); approximate: the approximate index for every engine
    prefix_index: PrefixIndexMode = "events"
    # Who sets a request's cache_salt (prefix-cache scope): the client (its own field, as
    # vLLM), or the router from the API key or a header, per tenant
    cache_salt_from: CacheSaltFrom = "client"
    cache_salt_header: str = "x-tenant-id"
    session_affinity: bool = True  # requests with the same x-session-id go to the same engine

    # -- conditional disaggregation --
    disagg_min_tokens: int = 0  # prompts estimated shorter than this skip the prefill step
    # skip the prefill step when the chosen decode engine already holds this fraction of the
    # prompt's blocks
    disagg_cached_fraction: float = 0.8
    chars_per_token: float = 4.0  # for the token estimate of text prompts
    on_no_prefill: OnNoPrefill = "fail"  # no healthy prefill engine: 503, or decode alone

    # -- holding requests while a model has no engine up (scale to zero, `hold`) --
    hold_timeout: float = 60.0  # seconds a request waits for an engine; 0: no holding (503)
    hold_queue_size: int = 100  # requests held per model; more get 503 at once
    # Models served even while no engine of theirs is known (a pool at zero); besides these,
    # every model discovery has shown since start.
    served_models: tuple[str, ...] = ()

    # -- retries and timeouts (seconds) --
    max_retries: int = 2  # further engines tried when one fails before the first byte
    request_timeout: float = 600.0  # longest wait for an engine's next bytes
    connect_timeout: float = 2.0
    # Connections to the engines for requests, all engines together; the health probes, scrapes
    # and tokenizer fetches have a pool of their own of the same bound.
    max_connections: int = 1024
    max_body_bytes: int = 10 << 20  # a larger request body gets 413 before it is read
    # Times one stream may move to another engine when its engine fails mid-stream (NVIDIA
    # Dynamo's --migration-limit); 0: a broken stream ends with an error event.
    migration_limit: int = 3

    # -- health --
    health_interval: float = 1.0  # active /health checks and /metrics scrapes, per engine
    health_timeout: float = 2.0
    eject_after_failures: int = 2  # consecutive failed requests that eject an engine
    eject_seconds: float = 5.0  # an ejected engine stays out at least this long

    # -- the engines' side (`upstream_auth`) --
    # Sent to every engine as `Authorization: Bearer`; None: no Authorization header at all
    # (a client's is the router's key, never the engines'). Out of repr: configs get logged.
    upstream_api_key: str | None = dataclasses.field(default=None, repr=False)
    upstream_ca_certs: str | None = None  # CAs for https:// engines; None: the system's

    # -- tracing (`baton.tracing`) --
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector for spans (vLLM's flag)

    def __post_init__(self) -> None:
        for field, value in (
            ("prefill_policy", self.prefill_policy),
            ("decode_policy", self.decode_policy),
        ):
            if value not in POLICIES:
                raise ValueError(f"{field} must be one of {POLICIES}, got {value!r}")
        if self.prefix_index not in ("events", "approximate"):
            raise ValueError(
                f"prefix_index must be events or approximate, got {self.prefix_index!r}"
            )
        if self.cache_salt_from not in ("client", "api-key", "header"):
            raise ValueError(
                f"cache_salt_from must be client, api-key or header, got {self.cache_salt_from!r}"
            )
        if not self.cache_salt_header:
            raise ValueError("cache_salt_header must not be empty")
        if self.on_no_prefill not in ("fail", "decode"):
            raise ValueError(
                f"on_no_prefill must be 'fail' or 'decode', got {self.on_no_prefill!r}"
            )
        positive = (
            ("prefix_block_chars", self.prefix_block_chars),
            ("prefix_index_blocks", self.prefix_index_blocks),
            ("chars_per_token", self.chars_per_token),
            ("request_timeout", self.request_timeout),
            ("connect_timeout", self.connect_timeout),
            ("max_connections", self.max_connections),
            ("max_body_bytes", self.max_body_bytes),
            ("health_interval", self.health_interval),
            ("health_timeout", self.health_timeout),
            ("eject_after_failures", self.eject_after_failures),
            ("hold_queue_size", self.hold_queue_size),
        )
        for field, number in positive:
            if number <= 0:
                raise ValueError(f"{field} must be > 0, got {number}")
        non_negative = (
            ("prefix_load_weight", self.prefix_load_weight),
            ("disagg_min_tokens", self.disagg_min_tokens),
            ("max_retries", self.max_retries),
            ("migration_limit", self.migration_limit),
            ("eject_seconds", self.eject_seconds),
            ("hold_timeout", self.hold_timeout),
        )
        for field, number in non_negative:
            if number < 0:
                raise ValueError(f"{field} must be >= 0, got {number}")
        if any(not model for model in self.served_models):
            raise ValueError("served_models must not contain an empty name")
        if self.upstream_api_key == "":
            raise ValueError("upstream_api_key must not be empty (None: send no key)")
        check_endpoint(self.otlp_traces_endpoint)
        if not 0 < self.disagg_cached_fraction <= 1:
            raise ValueError(
                f"disagg_cached_fraction must be in (0, 1], got {self.disagg_cached_fraction}"
            )
