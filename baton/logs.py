"""How every Baton process logs: a timestamp, the level, the component and the request id, as
text or as one JSON object a line (`--log-format json`), the shape log pipelines (Loki, Elastic,
Cloud Logging) parse without a grok pattern.

One request's lines on three pods (router, prefill engine, decode engine) carry one
`request_id`: servers set `REQUEST_ID` for the request they serve, and the formatters read it,
so no log call passes it. The format travels to child processes (the engine core, tensor
parallel workers) in `BATON_LOG_FORMAT`, which `configure` sets.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import os
import sys
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]
FORMAT_ENV = "BATON_LOG_FORMAT"
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
# Attributes every LogRecord has; any other one came from `extra=` and goes into the JSON object.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def add_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get(FORMAT_ENV) or "text",
        help=f"text lines, or one JSON object a line (default: ${FORMAT_ENV} or text)",
    )


def configure(level: str | int, fmt: str | None = None, component: str = "baton") -> None:
    """Sends every logger's records to stderr in `fmt` (default: `$BATON_LOG_FORMAT` or text),
    replacing any handler set before; the processes this one starts inherit the format."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or "text"
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    os.environ[FORMAT_ENV] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter(component) if fmt == "json" else TextFormatter(component))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


def _timestamp(record: logging.LogRecord) -> str:
    """UTC, ISO 8601 with milliseconds: what log pipelines sort and parse without help."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """`2026-12-03T18:55:00.123Z INFO router baton.router.router: message [request_id=...]`"""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{_timestamp(record)} {record.levelname} {self.component} {record.name}: "
            f"{record.getMessage()}"
        )
        request_id = REQUEST_ID.get()
        if request_id is not None:
            line += f" [request_id={request_id}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JSONFormatter(logging.Formatter):
    """One JSON object a line: time, level, component, logger, message, request_id when a
    request is being served, the fields passed with `extra=`, and the traceback as `exc_info`."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "component": self.component,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)
