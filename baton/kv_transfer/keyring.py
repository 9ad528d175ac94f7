"""The hand-off keyring: the secrets one service's prefill and decode engines share, which sign
the `kv_transfer_params` a prefill engine hands out and authenticate every exchange on the KV
ports. Torch-free: the API server signs nothing but verifies every decode request's params.

Where the secrets come from, first found wins: ``--kv-secret-file`` (in Kubernetes, the
operator's Secret mounted in the pod), ``$BATON_KV_SECRET`` (what `baton serve` sets for its
engines, one secret per run), else the user's own secret file, made on first use (0600) so that
engines one user starts on one machine agree, as Erlang nodes share a cookie.

A file holds one secret per line (``#`` comments and blank lines skipped). The first signs;
every one verifies, so a secret rotates without dropping a hand-off in flight: add the new one as
a second line everywhere, then move it first, then drop the old one once a lease's lifetime has
passed. Engines re-read the file when it changes. A secret's id is a hash of it, never
configured, so both sides name the same key without agreeing on anything else.

What a signature covers (`params_message`): every field a decode engine acts on (the engine id,
host, ports, the lease's request id and blocks, the prompt length and its token ids' hash, the
expiry), so a client may carry the params but not change where they point or what they describe.
On the KV ports every request carries a tag over the server's per-connection nonce and the
request's bytes (the lease it names among them), and every answer one over the request's tag:
each side proves the secret to the other, and nothing is replayed on another connection.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SECRET_ENV = "BATON_KV_SECRET"
TAG_BYTES = 32  # HMAC-SHA256
KEY_ID_CHARS = 8
_MIN_SECRET_CHARS = 16
_RELOAD_EVERY_S = 1.0  # how often a file-backed ring looks at the file's change time


def key_id(secret: bytes) -> str:
    """A secret's public name: a hash of it, so that it needs no configuring."""
    return hashlib.sha256(b"baton-kv-key-id\0" + secret).hexdigest()[:KEY_ID_CHARS]


def prompt_hash(token_ids: Sequence[int]) -> str:
    """The hash of a prompt's token ids that signed params carry (128 bits, hex)."""
    return hashlib.blake2b(array.array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def default_secret_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "baton" / "kv-secret"


@dataclass(frozen=True)
class _Keys:
    signing: str  # the id of the key that signs
    by_id: dict[str, bytes]


def _parse(text: str, where: str) -> _Keys:
    lines = [s.strip() for s in text.splitlines()]
    found = [s.encode() for s in lines if s and not s.startswith("#")]
    if not found:
        raise ValueError(f"{where} holds no secret")
    short = [i for i, s in enumerate(found) if len(s) < _MIN_SECRET_CHARS]
    if short:
        raise ValueError(
            f"{where}: secret {short[0] + 1} is shorter than {_MIN_SECRET_CHARS} characters"
        )
    return _Keys(key_id(found[0]), {key_id(s): s for s in found})


class KeyRing:
    """The secrets one engine signs and verifies with; thread-safe. Make one with `load`."""

    def __init__(self, text: str, source: str, path: Path | None = None) -> None:
        self.source = source  # where the secrets come from, for logs and errors
        self._path = path
        self._keys = _parse(text, source)
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()

    @classmethod
    def load(cls, secret_file: str | None = None) -> KeyRing:
        """The ring from ``secret_file``, else ``$BATON_KV_SECRET``, else the user's own file
        (made when missing). Raises ValueError naming what is wrong."""
        if secret_file:
            path = Path(secret_file)
            try:
                return cls(path.read_text(), f"--kv-secret-file {path}", path)
            except OSError as exc:
                raise ValueError(f"cannot read --kv-secret-file {path}: {exc}") from None
        env = os.environ.get(SECRET_ENV)
        if env:
            return cls(env, f"${SECRET_ENV}")
        path = default_secret_file()
        try:
            text = _read_or_make(path)
        except OSError as exc:
            raise ValueError(
                f"no hand-off secret: set --kv-secret-file or ${SECRET_ENV} (making {path} "
                f"failed: {exc})"
            ) from None
        return cls(text, str(path), path)

    # ---- keys

    def _current(self) -> _Keys:
        if self._path is not None and time.monotonic() - self._checked > _RELOAD_EVERY_S:
            self._reload()
        return self._keys

    def _file_stamp(self) -> tuple[float, int] | None:
        if self._path is None:
            return None
        try:
            st = self._path.stat()
        except OSError:
            return None
        return st.st_mtime, st.st_ino

    def _reload(self) -> None:
        with self._lock:
            self._checked = time.monotonic()
            stamp = self._file_stamp()
            if stamp is None or stamp == self._stamp:
                return
            try:
                assert self._path is not None
                keys = _parse(self._path.read_text(), self.source)
            except (OSError, ValueError) as exc:
                # Half-written or emptied: keep the keys we have rather than refuse every hand-off.
                logger.warning("keeping the hand-off keys: reading %s failed: %s", self.source, exc)
                return
            self._stamp = stamp
            if keys != self._keys:
                logger.info(
                    "hand-off keys from %s: signing with %s, verifying %s",
                    self.source,
                    keys.signing,
                    ", ".join(sorted(keys.by_id)),
                )
            self._keys = keys

    @property
    def signing_key_id(self) -> str:
        return self._current().signing

    def has(self, kid: str) -> bool:
        return kid in self._current().by_id

    # ---- MACs

    def sign(self, message: bytes) -> tuple[str, str]:
        """(the signing key's id, the signature of ``message`` as hex)."""
        keys = self._current()
        return keys.signing, _mac(keys.by_id[keys.signing], b"params", message).hex()

    def verify(self, kid: str, signature: str, message: bytes) -> bool:
        secret = self._current().by_id.get(kid)
        if secret is None:
            return False
        with contextlib.suppress(ValueError):
            return hmac.compare_digest(_mac(secret, b"params", message), bytes.fromhex(signature))
        return False

    def tag(self, kid: str, *parts: bytes) -> bytes | None:
        """The tag of an exchange on the KV ports under key ``kid``; None without that key."""
        secret = self._current().by_id.get(kid)
        return None if secret is None else _mac(secret, b"kv", *parts)

    def check(self, kid: str, tag: bytes, *parts: bytes) -> bool:
        want = self.tag(kid, *parts)
        return want is not None and hmac.compare_digest(want, tag)


def _mac(secret: bytes, purpose: bytes, *parts: bytes) -> bytes:
    # Length-prefixed parts: no two different part lists give the same input.
    h = hmac.new(secret, b"baton-" + purpose + b"\0", hashlib.sha256)
    for part in parts:
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.digest()


def new_secret() -> str:
    return secrets.token_hex(32)


def _read_or_make(path: Path) -> str:
    """The user's secret file, made 0600 with a fresh secret when missing. Engines starting
    together race to make it: the first link wins and the others read what it wrote."""
    with contextlib.suppress(FileNotFoundError):
        return path.read_text()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new_secret() + "\n")
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text()
