"""`baton router`: its flags, and the configs and discovery they make.

`add_routing_args` holds the flags that shape routing (policies, hand-off, retries, health);
`baton serve` passes them through to the router it starts.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from baton.cli import from_args
from baton.http_server import ListenConfig, add_listen_args, api_keys_from_args
from baton.router.config import POLICIES, RouterConfig
from baton.router.discovery import Discovery, Endpoint, StaticDiscovery
from baton.router.server import serve
from baton.tracing import add_tracing_args

UPSTREAM_API_KEY_ENV = "BATON_UPSTREAM_API_KEY"  # --upstream-api-key when the flag is absent


def add_routing_args(parser: argparse.ArgumentParser | Any) -> None:
    """The flags that shape routing, with `RouterConfig`'s defaults."""
    c = RouterConfig
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help=f"policy of every role unless --prefill-policy/--decode-policy say otherwise "
        f"(default: {c.decode_policy})",
    )
    parser.add_argument("--prefill-policy", choices=POLICIES, default=None)
    parser.add_argument("--decode-policy", choices=POLICIES, default=None)
    parser.add_argument(
        "--prefix-load-weight",
        type=float,
        default=c.prefix_load_weight,
        help="prefix-aware: how much load a full prefix match outweighs",
    )
    parser.add_argument("--prefix-block-chars", type=int, default=c.prefix_block_chars)
    parser.add_argument("--prefix-index-blocks", type=int, default=c.prefix_index_blocks)
    parser.add_argument(
        "--prefix-index",
        choices=("events", "approximate"),
        default=c.prefix_index,
        help="events: an exact index from the KV events of engines that publish them (the "
        "approximate one for the others); approximate: the router's own record for all",
    )
    parser.add_argument(
        "--cache-salt-from",
        choices=("client", "api-key", "header"),
        default=c.cache_salt_from,
        help="who sets a request's cache_salt (the prefix-cache scope): the client, or the "
        "router per tenant, from the API key or --cache-salt-header",
    )
    parser.add_argument("--cache-salt-header", default=c.cache_salt_header)
    parser.add_argument(
        "--session-affinity",
        action=argparse.BooleanOptionalAction,
        default=c.session_affinity,
        help="send requests with the same x-session-id header to the same engine",
    )
    parser.add_argument(
        "--disagg-min-tokens",
        type=int,
        default=c.disagg_min_tokens,
        help="prompts estimated shorter than this skip the prefill engine",
    )
    parser.add_argument(
        "--disagg-cached-fraction",
        type=float,
        default=c.disagg_cached_fraction,
        help="skip the prefill engine when the decode engine holds this fraction of the prompt",
    )
    parser.add_argument("--chars-per-token", type=float, default=c.chars_per_token)
    parser.add_argument(
        "--on-no-prefill",
        choices=("fail", "decode"),
        default=c.on_no_prefill,
        help="with no healthy prefill engine: answer 503, or serve on decode engines alone",
    )
    parser.add_argument(
        "--hold-timeout",
        type=float,
        default=c.hold_timeout,
        help="seconds a request waits for an engine when its model has no decode or aggregated "
        "engine up (a pool at zero) before a 503 with Retry-After; 0: a 503 at once",
    )
    parser.add_argument(
        "--hold-queue-size",
        type=int,
        default=c.hold_queue_size,
        help="requests held per model; more get a 503 with Retry-After at once",
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=c.max_retries,
        help="other engines tried when one fails before the first byte",
    )
    parser.add_argument(
        "--migration-limit",
        type=int,
        default=c.migration_limit,
        help="times a stream moves to another engine when its engine fails mid-stream (0: never)",
    )
    parser.add_argument("--request-timeout", type=float, default=c.request_timeout)
    parser.add_argument("--connect-timeout", type=float, default=c.connect_timeout)
    parser.add_argument("--max-connections", type=int, default=c.max_connections)
    parser.add_argument("--health-interval", type=float, default=c.health_interval)
    parser.add_argument("--health-timeout", type=float, default=c.health_timeout)
    parser.add_argument("--eject-after-failures", type=int, default=c.eject_after_failures)
    parser.add_argument("--eject-seconds", type=float, default=c.eject_seconds)


def add_args(parser: argparse.ArgumentParser) -> None:
    """`baton router`'s flags."""
    add_listen_args(parser, ListenConfig)
    parser.add_argument(
        "--router-shutdown-timeout", type=float, default=ListenConfig.shutdown_timeout
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=RouterConfig.max_body_bytes,
        help="a larger request body gets 413 (the engines' --max-body-bytes; a router-only "
        "flag, so that baton serve's engine flag of that name does not clash)",
    )
    parser.add_argument("--access-log", action="store_true")
    upstream = parser.add_argument_group("the engines' side")
    upstream.add_argument(
        "--upstream-api-key",
        default=None,
        metavar="KEY",
        help=f"sent to every engine as `Authorization: Bearer KEY` (the engines' --api-key; "
        f"default: ${UPSTREAM_API_KEY_ENV}). Without it no Authorization header goes to the "
        f"engines: a client's is for the router",
    )
    upstream.add_argument(
        "--upstream-ca-certs",
        default=None,
        metavar="PEM",
        help="CA bundle that https:// engines' certificates are verified with (default: the "
        "system's)",
    )
    add_tracing_args(parser)
    parser.add_argument(
        "--served-model",
        dest="served_models",
        action="append",
        default=[],
        metavar="NAME",
        help="a model this router serves even while it sees no engine of it (a pool at zero): "
        "its requests are held, not 404 (repeatable; models discovery showed are remembered)",
    )
    static = parser.add_argument_group("static discovery (URLs may repeat the flag)")
    for role in ("prefill", "decode"):
        static.add_argument(
            f"--{role}", action="append", default=[], metavar="URL", help=f"a {role} engine"
        )
    static.add_argument(
        "--engine", action="append", default=[], metavar="URL", help="an aggregated engine"
    )
    k8s = parser.add_argument_group("Kubernetes discovery (EndpointSlices)")
    k8s.add_argument("--discovery", choices=("static", "kubernetes"), default="static")
    k8s.add_argument("--namespace", default=None)
    k8s.add_argument("--all-namespaces", action="store_true")
    k8s.add_argument(
        "--selector", default="", help="label selector of the engines' Services: k=v,k2=v2"
    )
    add_routing_args(parser.add_argument_group("routing"))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` of `add_routing_args`' flags; ValueError if invalid."""
    policy = args.policy or RouterConfig.decode_policy
    overrides: dict[str, Any] = {}
    if hasattr(args, "upstream_api_key"):  # `baton serve` passes only the routing flags
        key = args.upstream_api_key or os.environ.get(UPSTREAM_API_KEY_ENV) or None
        overrides["upstream_api_key"] = key
    if hasattr(args, "served_models"):
        overrides["served_models"] = tuple(args.served_models)
    return from_args(
        RouterConfig,
        args,
        prefill_policy=args.prefill_policy or policy,
        decode_policy=args.decode_policy or policy,
        **overrides,
    )


def parse_selector(text: str) -> dict[str, str]:
    """`k=v,k2=v2` as a dict; ValueError naming the bad part."""
    selector: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--selector must be key=value pairs separated by commas: {part!r}")
        selector[key.strip()] = value.strip()
    return selector


def discovery_from_args(args: argparse.Namespace) -> Discovery:
    """Static discovery of the URL flags, or Kubernetes discovery of the selector."""
    urls = [*args.prefill, *args.decode, *args.engine]
    if args.discovery == "kubernetes":
        if urls:
            raise ValueError("--prefill/--decode/--engine URLs need --discovery static")
        if args.all_namespaces == (args.namespace is not None):
            raise ValueError("--discovery kubernetes needs --namespace NS or --all-namespaces")
        # Imported here: only a router in Kubernetes needs the Kubernetes client.
        from baton.router.k8s_discovery import KubernetesDiscovery

        return KubernetesDiscovery(args.namespace, parse_selector(args.selector))
    if not urls:
        raise ValueError("give at least one engine: --prefill URL, --decode URL or --engine URL")
    endpoints = [Endpoint(url.rstrip("/"), "prefill") for url in args.prefill]
    endpoints += [Endpoint(url.rstrip("/"), "decode") for url in args.decode]
    endpoints += [Endpoint(url.rstrip("/"), "both") for url in args.engine]
    return StaticDiscovery(endpoints)


def listen_from_args(args: argparse.Namespace) -> ListenConfig:
    """Where `baton router` listens (its shutdown flag is named apart from the engines')."""
    return from_args(
        ListenConfig,
        args,
        shutdown_timeout=args.router_shutdown_timeout,
        api_keys=api_keys_from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    """`baton router`: route until stopped; the exit code says how it ended."""
    config = config_from_args(args)
    discovery = discovery_from_args(args)
    return serve(config, discovery, listen_from_args(args))
