"""Every process logs with a timestamp, its component and the request id; `--log-format json`
makes every line of a real engine server (its own, uvicorn's and the EngineCore child's) one
JSON object."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from baton import logs
from tests.support.engine_server import NAME, Server

_STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.getLogger("baton.test").makeRecord(
        "baton.test", logging.INFO, __file__, 1, msg, args, None
    )
    record.__dict__.update(extra)
    return record


def test_text_lines_have_time_level_component_and_request_id() -> None:
    formatter = logs.TextFormatter("router")
    assert re.fullmatch(
        rf"{_STAMP} INFO router baton.test: hello 3", formatter.format(_record("hello %d", 3))
    )
    token = logs.REQUEST_ID.set("req-1")
    try:
        line = formatter.format(_record("chose %s", "e1"))
    finally:
        logs.REQUEST_ID.reset(token)
    assert line.endswith("chose e1 [request_id=req-1]")


def test_json_lines_carry_fields_extra_and_traceback() -> None:
    formatter = logs.JSONFormatter("engine")
    token = logs.REQUEST_ID.set("abc")
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record('quote " and\nnewline', bytes_pulled=12)
        record.exc_info = sys.exc_info()
    finally:
        logs.REQUEST_ID.reset(token)
    token = logs.REQUEST_ID.set("abc")
    try:
        entry = json.loads(formatter.format(record))
    finally:
        logs.REQUEST_ID.reset(token)
    assert re.fullmatch(_STAMP, entry["time"])
    assert entry["level"] == "INFO" and entry["component"] == "engine"
    assert entry["logger"] == "baton.test" and entry["message"] == 'quote " and\nnewline'
    assert entry["request_id"] == "abc" and entry["bytes_pulled"] == 12
    assert "ValueError: boom" in entry["exc_info"]


def test_a_bad_format_is_refused_and_the_cli_offers_json() -> None:
    with pytest.raises(ValueError, match="json"):
        logs.configure("INFO", "xml")
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli", "--log-format", "xml", "tiny-model", "x"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "invalid choice: 'xml'" in out.stderr


def test_json_logs_of_a_real_engine_server_and_its_core(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    server = Server(
        tiny_model(), tmp_path / "engine.log", "--log-format", "json", "--log-level", "INFO"
    )
    try:
        server.wait_ready()
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": NAME, "prompt": "hi", "max_tokens": 2},
            headers={"x-request-id": "client-42"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    entries = [json.loads(line) for line in server.log_path.read_text().splitlines() if line]
    components = {e["component"] for e in entries}
    assert {"engine", "engine-core"} <= components, components
    for e in entries:
        assert re.fullmatch(_STAMP, e["time"]) and e["level"] and e["logger"], e
