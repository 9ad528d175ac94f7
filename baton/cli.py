"""The `baton` command: `baton serve` (router + engines on one machine), `baton engine` (one
OpenAI-compatible engine server), `baton router`, `baton operator`, `baton tiny-model`,
`baton demo`.

Each subcommand lives in the module that implements it, as a pair `add_args(parser)` and
`run(args) -> int`; only the chosen one is imported, so `baton router` and `baton operator` never
import torch. `from_args` turns their flags into their config dataclasses.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from typing import TYPE_CHECKING, Any, TypeVar

from baton import logs

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    Config = TypeVar("Config", bound=DataclassInstance)

# name -> (module with add_args/run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("baton.serve", "run a router and prefill and decode engines on this machine"),
    "engine": ("baton.engine.api.cli", "serve one model over an OpenAI-compatible HTTP API"),
    "router": ("baton.router.cli", "the cluster-wide OpenAI endpoint in front of engines"),
    "operator": ("baton.operator.cli", "the Kubernetes operator for InferenceService resources"),
    "tiny-model": ("baton.engine.models.tiny", "write a deterministic random Hugging Face model"),
    "demo": ("baton.engine.demo", "offline generation on a model (default: the built-in one)"),
}


def from_args(cls: type[Config], args: argparse.Namespace, **overrides: Any) -> Config:
    """A `cls` whose fields take the values of the flags of the same name (dest) in `args`;
    `overrides` for fields whose flag has another name or meaning. Fields without a flag keep
    their defaults. ValueError if the config refuses the values."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if f.init and f.name not in overrides and hasattr(args, f.name)
    }
    return cls(**values, **overrides)


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option)."""
    skip_next = False
    for word in argv:
        if skip_next:
            skip_next = False
        elif word in ("--log-level", "--log-format"):
            skip_next = True
        elif not word.startswith("-"):
            return word
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.split("\n\n")[0])
    logs.add_log_args(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _chosen(argv)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_args(command)
            command.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logs.configure(args.log_level, args.log_format, component=args.command)
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        sys.exit(2)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
