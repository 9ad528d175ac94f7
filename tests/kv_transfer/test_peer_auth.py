"""Who may talk to a KV port: a TCP block server and a NIXL side channel answer only a peer that
proves the hand-off key over its connection's nonce, and a reader believes only a server that
proves it back; the keyring signs params, rotates, and makes its default secret once."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from baton.kv_transfer import keyring as keyring_mod
from baton.kv_transfer.fingerprint import Fingerprint
from baton.kv_transfer.keyring import TAG_BYTES, KeyRing, new_secret, prompt_hash
from baton.kv_transfer.leases import LeaseTable, Status
from baton.kv_transfer.nixl import channel
from baton.kv_transfer.nixl.server import SideChannelServer
from baton.kv_transfer.params import KVTransferParams, RemotePrefill
from baton.kv_transfer.sockets import GREETING, KVConnectionPool
from baton.kv_transfer.tcp.reader import read_blocks
from baton.kv_transfer.tcp.server import KVBlockServer
from baton.kv_transfer.tcp.wire import REPLY, pack_request
from tests.kv_transfer.helpers import BB, ENGINE, SHAPE, as_bytes, deadline, fake_server, make_cache
from tests.support.kv_wire import KEYS, Request, lease_at, side_call

OTHER = KeyRing(new_secret(), "another service's key")


def _raw_exchange(port: int, request: bytes) -> bytes:
    """Sends `request` after the greeting on a new connection; everything the server sends
    back until it hangs up."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.recv(GREETING.size, socket.MSG_WAITALL)
        sock.sendall(request)
        out = b""
        while chunk := sock.recv(1 << 16):
            out += chunk
        return out


@pytest.fixture
def leased(server: KVBlockServer) -> KVBlockServer:
    server.leases.lease("r", [0, 1], time.time() + 30)
    return server


# ---------------------------------------------------------------------- TCP block server


def test_a_reader_without_the_key_gets_nothing(leased: KVBlockServer) -> None:
    """A reader holding another key is UNAUTHORIZED: no bytes land, the lease stays for the
    rightful reader, who then reads it."""
    local = make_cache(seed=3)
    before = local.clone()
    result = read_blocks(
        lease_at(leased.port, ENGINE, "r", OTHER), [0, 1], local, [0, 1], deadline()
    )
    assert result.reason == "UNAUTHORIZED" and result.num_bytes == 0
    assert torch.equal(as_bytes(local), as_bytes(before))
    assert read_blocks(lease_at(leased.port, ENGINE, "r"), [0, 1], local, [0, 1], deadline()).ok


@pytest.mark.parametrize("tag", [b"", bytes(TAG_BYTES), b"\x01" * TAG_BYTES])
def test_an_untagged_or_forged_request_learns_nothing(leased: KVBlockServer, tag: bytes) -> None:
    """A request with no tag, or a made-up one, for a lease that exists: the server answers
    UNAUTHORIZED with no payload (nothing says whether the lease exists) and hangs up."""
    head, body = pack_request(KEYS.signing_key_id, ENGINE, "r", [0, 1], leased.leases.block_bytes)
    answer = _raw_exchange(leased.port, head + body + tag.ljust(TAG_BYTES, b"\0"))
    assert len(answer) == REPLY.size + TAG_BYTES
    _, status, _, total, checksum = REPLY.unpack(answer[: REPLY.size])
    assert (status, total, checksum) == (Status.UNAUTHORIZED, 0, 0)
    assert answer[REPLY.size :] == bytes(TAG_BYTES)
    assert leased.leases.release("r")  # untouched


def test_a_request_replayed_on_another_connection_is_refused(leased: KVBlockServer) -> None:
    """A tag binds its request to the nonce of the connection it was made for."""
    head, body = pack_request(KEYS.signing_key_id, ENGINE, "r", [0, 1], leased.leases.block_bytes)
    tag = KEYS.tag(KEYS.signing_key_id, os.urandom(16), head, body)
    assert tag is not None
    answer = _raw_exchange(leased.port, head + body + tag)
    assert REPLY.unpack(answer[: REPLY.size])[1] == Status.UNAUTHORIZED


def test_a_server_without_the_key_is_not_believed() -> None:
    """A peer at the lease's address that cannot prove the key (it answers OK, with data that
    even passes the checksum) is UNAUTHENTICATED: the reader takes none of its bytes."""
    served = make_cache(seed=9)

    def impostor(request: Request) -> None:
        request.conn.sendall(REPLY.pack(b"BKVA", Status.OK, 1, 2, 3) + os.urandom(TAG_BYTES))
        request.conn.sendall(as_bytes(served[0]).numpy().tobytes())

    port, thread = fake_server(impostor)
    local = torch.zeros(SHAPE)
    result = read_blocks(lease_at(port, ENGINE, "r"), [0], local, [0], deadline())
    thread.join(2)
    assert result.reason == "UNAUTHENTICATED" and result.num_bytes == 0
    assert not local.any()


def test_a_rotated_ring_serves_both_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotation without a dropped hand-off: a server whose file lists the new key first and the
    old one second serves readers under either; once the old line goes, its readers are refused,
    and the ring picked the change up without a restart."""
    monkeypatch.setattr(keyring_mod, "_RELOAD_EVERY_S", 0.0)
    old, new = new_secret(), new_secret()
    path = tmp_path / "keys"
    path.write_text(f"{old}\n")
    ring = KeyRing.load(str(path))
    old_ring, new_ring = KeyRing(old, "old"), KeyRing(new, "new")
    assert ring.signing_key_id == old_ring.signing_key_id
    srv = KVBlockServer(make_cache(), ENGINE, ring)
    srv.start()
    try:
        path.write_text(f"# rotating\n{new}\n{old}\n")
        os.utime(path, (time.time() + 5, time.time() + 5))  # a change within the mtime's grain
        assert ring.signing_key_id == new_ring.signing_key_id
        for i, reader in enumerate((old_ring, new_ring)):
            srv.leases.lease(f"r{i}", [i], time.time() + 30)
            local = torch.zeros(SHAPE)
            lease = lease_at(srv.port, ENGINE, f"r{i}", reader)
            assert read_blocks(lease, [i], local, [0], deadline()).ok
        path.write_text(f"{new}\n")
        os.utime(path, (time.time() + 10, time.time() + 10))
        srv.leases.lease("late", [3], time.time() + 30)
        lease = lease_at(srv.port, ENGINE, "late", old_ring)
        assert read_blocks(lease, [3], torch.zeros(SHAPE), [0], deadline()).reason == "UNAUTHORIZED"
    finally:
        srv.stop()


# ---------------------------------------------------------------------- NIXL side channel


@pytest.fixture
def side_channel() -> Iterator[tuple[SideChannelServer, LeaseTable]]:
    """A side channel without NIXL itself (its agent is only polled while a read holds a
    lease): what it answers, and to whom, is all in Baton's code."""
    leases = LeaseTable(make_cache(), ENGINE)
    hello = channel.Reply(Status.OK, engine_id=ENGINE, agent_metadata=b"agent-metadata")
    srv = SideChannelServer("127.0.0.1", 0, leases, hello, None, KEYS)
    srv.start()
    yield srv, leases
    srv.stop()
    leases.stop()


def test_agent_metadata_goes_only_to_holders_of_the_key(
    side_channel: tuple[SideChannelServer, LeaseTable],
) -> None:
    """Hello from a peer without the key is UNAUTHORIZED with no metadata and no engine id;
    from a holder of the key it is the engine's answer."""
    srv, _ = side_channel
    refused = side_call(srv.port, channel.Hello(ENGINE), OTHER)
    assert refused is not None and refused.status == Status.UNAUTHORIZED
    assert refused.agent_metadata == b"" and refused.engine_id == ""
    answer = side_call(srv.port, channel.Hello(ENGINE))
    assert answer is not None and answer.status == Status.OK
    assert answer.agent_metadata == b"agent-metadata"


def test_lookups_and_releases_need_the_key(
    side_channel: tuple[SideChannelServer, LeaseTable],
) -> None:
    """Without the key a Lookup gets no checksums and a Release or Done frees nothing."""
    srv, leases = side_channel
    leases.lease("r", [1, 2], time.time() + 30)
    lookup = channel.Lookup(ENGINE, "r", [1, 2], leases.block_bytes, 1.0)
    refused = side_call(srv.port, lookup, OTHER)
    assert refused is not None and refused.status == Status.UNAUTHORIZED and refused.crcs == []
    side_call(srv.port, channel.Release(ENGINE, "r"), OTHER)
    side_call(srv.port, channel.Done(ENGINE, "r"), OTHER)
    assert leases.claimed() == [] and not leases.holding()
    answer = side_call(srv.port, lookup)
    assert answer is not None and answer.status == Status.OK and len(answer.crcs) == 2


def test_a_reader_believes_only_a_side_channel_that_proves_the_key() -> None:
    """A side channel holding another key: its OK to Hello is not taken (UNAUTHENTICATED)."""
    leases = LeaseTable(make_cache(), ENGINE)
    hello = channel.Reply(Status.OK, engine_id=ENGINE, agent_metadata=b"md")
    srv = SideChannelServer("127.0.0.1", 0, leases, hello, None, _Lenient(OTHER))
    port = srv.start()
    try:
        with KVConnectionPool() as pool:
            peer = channel.Channel(pool, "127.0.0.1", port, KEYS, KEYS.signing_key_id)
            reply = channel.call(peer, channel.Hello(ENGINE), deadline())
        assert isinstance(reply, str) and reply.startswith("UNAUTHENTICATED"), reply
    finally:
        srv.stop()
        leases.stop()


class _Lenient(KeyRing):
    """An impostor's ring: it lets every request in and tags its answers with its own key."""

    def __init__(self, ring: KeyRing) -> None:
        self.__dict__.update(ring.__dict__)

    def check(self, kid: str, tag: bytes, *parts: bytes) -> bool:
        return True

    def tag(self, kid: str, *parts: bytes) -> bytes | None:
        return super().tag(self.signing_key_id, *parts)


# ---------------------------------------------------------------------- signed params


def _remote() -> RemotePrefill:
    return RemotePrefill("e" * 32, "10.0.0.7", 7000, "cmpl-1-0", [4, 5, 6], 40, 1e9, (7000,))


def test_signed_params_verify_only_unchanged() -> None:
    """Signed params survive the JSON round trip a client makes; a change to any field a decode
    engine acts on (the prompt's hash and the prefill engine's fingerprint among them), another
    key, or no signature is named as such."""
    prompt = list(range(40))
    signed = _remote().signed(KEYS, prompt)
    back = KVTransferParams.parse(KVTransferParams.lease(signed).to_json())
    assert back is not None and back.remote is not None
    assert back.remote.unverified(KEYS) is None
    assert back.remote.prompt_hash == prompt_hash(prompt)
    for field, value in [
        ("engine_id", "f" * 32),
        ("host", "10.0.0.8"),
        ("port", 7001),
        ("ports", (7001,)),
        ("request_id", "cmpl-2-0"),
        ("block_ids", [4, 5, 7]),
        ("num_prompt_tokens", 41),
        ("lease_expires_at", 2e9),
        ("prompt_hash", prompt_hash(prompt[::-1])),
        ("fingerprint", Fingerprint(dtype="bfloat16")),
    ]:
        changed = signed.__class__(**{**_fields(signed), field: value})
        assert "changed after" in (changed.unverified(KEYS) or ""), field
    assert "does not hold" in (signed.unverified(OTHER) or "")
    assert "not signed" in (_remote().unverified(KEYS) or "")


def _fields(r: RemotePrefill) -> dict[str, object]:
    return {f: getattr(r, f) for f in r.__struct_fields__}


def test_the_default_secret_file_is_made_once_and_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --kv-secret-file or $BATON_KV_SECRET, engines one user starts share a secret
    file made on first use (0600); engines starting together all end up with the same one."""
    monkeypatch.delenv(keyring_mod.SECRET_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    rings: list[KeyRing] = []
    threads = [threading.Thread(target=lambda: rings.append(KeyRing.load())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = tmp_path / "baton" / "kv-secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len({r.signing_key_id for r in rings}) == 1
    assert [p.name for p in path.parent.iterdir()] == ["kv-secret"]  # no temporary left


def test_bad_secrets_stop_the_start(tmp_path: Path) -> None:
    """An empty or short secret file, or a missing one, is a ValueError naming the file."""
    for text in ("", "# only a comment\n", "short\n"):
        path = tmp_path / "keys"
        path.write_text(text)
        with pytest.raises(ValueError, match=str(path)):
            KeyRing.load(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        KeyRing.load(str(tmp_path / "missing"))


def test_an_engine_with_an_unreadable_secret_does_not_start(tmp_path: Path) -> None:
    """`baton engine --role prefill` with a secret file it cannot use exits 2 naming the file,
    before it loads anything."""
    missing = tmp_path / "keys"
    done = subprocess.run(
        [sys.executable, "-m", "baton.cli", "engine", "--role", "prefill",
         "--kv-secret-file", str(missing)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and str(missing) in done.stderr, done.stderr


def test_a_header_asking_for_more_blocks_than_the_cache_has_is_refused_unread(
    server: KVBlockServer,
) -> None:
    """A peer without the key cannot make the server allocate for millions of block ids: a
    header naming more blocks than the cache holds is BAD_REQUEST before the body is read."""
    head, _ = pack_request(KEYS.signing_key_id, ENGINE, "r", [0] * (SHAPE[0] + 1), BB)
    answer = _raw_exchange(server.port, head)
    assert REPLY.unpack(answer[: REPLY.size])[1] == Status.BAD_REQUEST
