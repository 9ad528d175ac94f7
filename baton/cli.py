"""The `baton` command: `baton engine` (the OpenAI-compatible engine server), `baton tiny-model`,
`baton demo` (offline generation)."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _tiny_model(args: argparse.Namespace) -> None:
    from baton.engine.models.tiny import write_tiny_model

    path = write_tiny_model(args.path, args.arch, args.size, seed=args.seed)
    print(f"wrote a {args.size} {args.arch} model to {path}")


def _demo(args: argparse.Namespace) -> None:
    from baton import LLM, SamplingParams

    llm = LLM(args.model, max_model_len=args.max_model_len)
    prompts = [
        "The relay team passed the baton",
        "Disaggregated serving splits prefill and decode so that",
        "Paged attention stores the KV cache in blocks",
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(f"prompt: {out.prompt!r}\n  -> {out.outputs[0].text!r}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{tokens} tokens in {elapsed:.2f} s ({tokens / elapsed:.0f} tok/s)")
    print(f"model: {llm.engine.model_path} (a randomly initialised model: the text is noise)")


def _engine(args: argparse.Namespace) -> None:
    from baton.engine.api.server import configs_from_args, serve

    sys.exit(serve(*configs_from_args(args)))


def build_parser() -> argparse.ArgumentParser:
    from baton.engine.api.server import add_server_args
    from baton.engine.models.tiny import ARCHITECTURES, SIZES

    parser = argparse.ArgumentParser(prog="baton", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    engine = sub.add_parser("engine", help="serve one model over an OpenAI-compatible HTTP API")
    add_server_args(engine)
    engine.set_defaults(func=_engine)

    tiny = sub.add_parser("tiny-model", help="write a deterministic random Hugging Face model")
    tiny.add_argument("path")
    tiny.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    tiny.add_argument("--size", choices=SIZES, default="tiny")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny_model)

    demo = sub.add_parser("demo", help="offline generation on a model (default: the built-in one)")
    demo.add_argument("--model", default=None)
    demo.add_argument("--max-model-len", type=int, default=1024)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"baton: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
