"""Hand-offs only between engines that agree: real prefill and decode engine processes that differ
in one thing a KV block's meaning depends on (other weights of the same shape, a float16 engine
against bfloat16 ones, another chat template giving a prompt of the same length). The decode
engine never answers from the other side's KV: it recomputes (its own answer) or, under policy
`fail`, answers a clear error, and counts the reason. The fingerprint itself: each field it
covers changes it, nothing else does."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.engine import compatibility
from baton.engine.models.loader import weight_files
from baton.engine.models.tiny import write_tiny_model
from tests.support.engine_server import Server, expect_error, stop_all

pytestmark = pytest.mark.slow

BLOCK = "8"
OTHER_TEMPLATE = (  # the tiny model's template with ':' where it has '\n': as many tokens
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + ':' + message['content'] + '<|im_end|>:' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant:' }}{%- endif %}"
)


def _with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    config_path = dst / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("compat")
    model = write_tiny_model(tmp / "model", "llama", "tiny", seed=0)
    other_weights = write_tiny_model(tmp / "retrained", "llama", "tiny", seed=1)
    # bfloat16 everywhere but the float16 decode engine: on CPU that one computes in bfloat16
    # too (same bytes per block), and still must not take the others' KV.
    bf16 = ("--block-size", BLOCK, "--dtype", "bfloat16")
    decode = (*bf16, "--role", "decode")
    plan = {
        "prefill": (model, (*bf16, "--role", "prefill")),
        "weights": (other_weights, decode),
        "dtype": (model, ("--block-size", BLOCK, "--dtype", "float16", "--role", "decode")),
        # vLLM's --chat-template, the template itself on the command line
        "chat_template": (model, (*decode, "--chat-template", OTHER_TEMPLATE)),
    }
    servers = {
        name: Server(path, tmp / f"{name}.log", *flags) for name, (path, flags) in plan.items()
    }
    try:
        for server in servers.values():
            server.wait_ready(90.0 * len(servers))
        yield servers
    finally:
        stop_all(servers.values(), drain_seconds=0.5)


def _chat(server: Server, **extra: Any) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the relay team passed the baton"}],
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def _incompatible(server: Server, reason: str) -> float:
    key = f'baton:kv_transfer_incompatible_total{{reason="{reason}"}}'
    return server.metrics().get(key, 0.0)


@pytest.mark.parametrize("differs", ["weights", "dtype", "chat_template"])
def test_a_decode_engine_that_differs_never_answers_from_the_others_kv(
    engines: dict[str, Server], differs: str
) -> None:
    """The prefill engine's params reach a decode engine that differs in `differs`: recompute
    gives the decode engine's own answer and counts the reason; `fail` is a 503 naming it."""
    prefill, decode = engines["prefill"], engines[differs]
    health = [httpx.get(f"{s.url}/health").json() for s in (prefill, decode)]
    assert health[0]["fingerprint"] != health[1]["fingerprint"]
    ours, theirs = health[0]["compatibility"], health[1]["compatibility"]
    assert next(k for k in ours if ours[k] != theirs[k]) == differs
    own = _text(_chat(decode))
    before = _incompatible(decode, differs)
    for policy in ("recompute", "fail"):
        step = _chat(prefill, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert step.status_code == 200, step.text
        params = step.json()["kv_transfer_params"] | {"kv_load_failure_policy": policy}
        answer = _chat(decode, kv_transfer_params=params)
        if policy == "recompute":
            assert _text(answer) == own
        else:
            error = expect_error(answer, 503)
            assert f"INCOMPATIBLE: {differs} differs" in error["message"]
    assert _incompatible(decode, differs) == before + 2
    metrics = decode.metrics()
    assert metrics.get("baton:kv_transfer_bytes_total", 0.0) == 0.0  # nothing was pulled
    # The refusing engine released both leases: the prefill engine holds no blocks for them
    # (it would for its 30 s lease time otherwise).
    deadline = time.monotonic() + 5
    while prefill.metrics()["baton:kv_blocks_leased{}"] > 0:
        assert time.monotonic() < deadline, "the refused leases were not released"
        time.sleep(0.05)


def test_the_chat_template_case_has_a_prompt_of_the_same_length(
    engines: dict[str, Server],
) -> None:
    """The premise of the template case: the two templates render prompts of equal token count
    and other ids, the case a prompt-length check alone would let through."""
    messages = [{"role": "user", "content": "the relay team passed the baton"}]
    ids = []
    for name in ("prefill", "chat_template"):
        r = httpx.post(
            f"{engines[name].url}/tokenize",
            json={"model": "tiny", "messages": messages, "add_generation_prompt": True},
        )
        assert r.status_code == 200, r.text
        ids.append(r.json()["tokens"])
    assert len(ids[0]) == len(ids[1]) and ids[0] != ids[1]


def test_the_fingerprint_covers_what_it_says(tmp_path: Path) -> None:
    """Every covered field changes the fingerprint; a copy of the same model in another folder
    (another path, the same bytes) does not."""
    model = write_tiny_model(tmp_path / "a", "llama", "tiny", seed=0)

    def fp(path: Path, **overrides: Any) -> Any:
        settings: dict[str, Any] = dict(
            dtype="float32", kv_cache_dtype="float32", block_size=16,
            block_shape=(2, 2, 16, 2, 16), tensor_parallel_size=1,
        )  # fmt: skip
        settings.update(overrides)
        return compatibility.compute(path, path, weight_files(path), **settings)

    base = fp(model)
    assert fp(shutil.copytree(model, tmp_path / "copy")) == base
    changed = {
        "weights": fp(write_tiny_model(tmp_path / "b", "llama", "tiny", seed=1)),
        "chat_template": fp(_with_template(model, tmp_path / "t", OTHER_TEMPLATE)),
        "dtype": fp(model, dtype="bfloat16"),
        "kv_cache_dtype": fp(model, kv_cache_dtype="float16"),
        "block_size": fp(model, block_size=8),
        "kv_layout": fp(model, tensor_parallel_size=2),
    }
    for field, other in changed.items():
        assert base.differences(other) == [field] and base.digest != other.digest, field
    # --chat-template is the same template as one in the tokenizer's folder
    flag = fp(model, chat_template=OTHER_TEMPLATE)
    assert flag.differences(changed["chat_template"]) == []
    config = json.loads((model / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (model / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = tokenizer["added_tokens"][:-1]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert base.differences(fp(model)) == ["model", "tokenizer"]
