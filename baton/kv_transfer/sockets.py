"""The socket plumbing both KV transports share: exact reads, kernel I/O timeouts and deadlines,
client connections, the threaded server their block servers and side channels run on, and the
pool of idle reader connections their exchanges run on.

Every connection opens with the server's greeting: a magic and a fresh random nonce, which both
sides mix into the tags that authenticate each exchange on it (``keyring.py``), so that nothing
sent on one connection can be replayed on another.

Sockets run in blocking mode with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO) rather than Python's
socket timeouts: a Python timeout turns every recv into poll + non-blocking recv, which halved the
loopback rate of a 16 MiB read in ``bench/kv_transfer.py``. A kernel timeout bounds each call, not
a whole exchange, so a reader with a deadline re-arms it (``arm``) before every call.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

logger = logging.getLogger(__name__)

# How often the accept loop looks at the stop flag; bounds how long stop() waits for it.
_ACCEPT_POLL_S = 0.05
# A pooled connection idle longer than this is closed rather than reused; kept well under the
# servers' default io_timeout (30 s), after which a server closes an idle connection.
_POOL_MAX_IDLE_S = 10.0
_POOL_MAX_IDLE_PER_PEER = 4
# At most this many buffers per sendmsg (Linux's IOV_MAX is 1024).
_MAX_IOV = 512

T = TypeVar("T")

# magic, the connection's nonce, padding: 64 bytes, so that what follows stays aligned (wire.py)
GREETING = struct.Struct("!4s16s44x")
GREETING_MAGIC = b"BKVN"


def _timeval(seconds: float) -> bytes:
    # A zero timeval means "never time out", so round up to at least one microsecond.
    micros = max(1, int(seconds * 1e6))
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel send and receive timeouts on a blocking socket (see the module docstring)."""
    sock.settimeout(None)
    timeval = _timeval(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def arm(sock: socket.socket, deadline: float, *, send: bool = True) -> None:
    """Sets the kernel timeouts to the time left before ``deadline`` (``time.monotonic()``);
    TimeoutError once it has passed. ``send=False`` sets only the receive timeout, for a run of
    receives (one system call rather than two)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    if send:
        set_io_timeout(sock, left)
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))


def is_timeout(exc: BaseException) -> bool:
    """Whether exc is a kernel socket timeout (EAGAIN from SO_RCVTIMEO/SO_SNDTIMEO) or Python's."""
    if isinstance(exc, TimeoutError):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """n bytes; None on a clean EOF before the first byte, ConnectionError on a short one. With
    a ``deadline`` the kernel timeouts are re-armed (``arm``) before each receive."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            arm(sock, deadline, send=False)
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_all(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> None:
    """Sends ``parts`` (bytes, or memoryviews of bytes) in order, gathered into as few system
    calls as the kernel takes (usually one), resuming after a partial send as ``sendall`` does."""
    left, i = list(parts), 0
    while i < len(left):
        sent = sock.sendmsg(left[i : i + _MAX_IOV])
        while i < len(left) and sent >= len(left[i]):
            sent -= len(left[i])
            i += 1
        if sent:
            left[i] = memoryview(left[i])[sent:]


def connect(
    host: str, port: int, deadline: float, *, rcvbuf: int | None = None
) -> socket.socket | str:
    """A new TCP_NODELAY connection to (host, port) opened by ``deadline``; else the error, as
    ``DEADLINE: ...`` or ``CONNECT_FAILED: ...``. ``rcvbuf`` sizes the receive buffer."""
    left = deadline - time.monotonic()
    if left <= 0:
        return f"DEADLINE: connecting to {host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=left)
    except TimeoutError:
        return f"DEADLINE: connecting to {host}:{port}"
    except OSError as exc:
        return f"CONNECT_FAILED: {host}:{port}: {exc}"
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    return sock


class ThreadedServer:
    """A listening socket that serves each connection on its own daemon thread.

    A connection's thread calls ``serve_one(conn)``, which subclasses implement, until it returns
    False, the peer hangs up or errs, or the server stops; every send and receive is bounded by
    ``io_timeout``, so a peer that stalls mid-exchange cannot pin a thread forever. Connections
    are few and long-lived (readers pool them), so a thread each is cheaper than an event loop's
    per-call overhead.
    """

    def __init__(self, host: str, port: int, *, name: str, io_timeout: float = 30.0) -> None:
        self._host = host
        self._port = port
        self._io_timeout = io_timeout
        self._name = name
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}

    @property
    def port(self) -> int:
        """The bound port once started (the configured one before)."""
        return self._port

    def start(self) -> int:
        """Binds, starts accepting in a daemon thread, and returns the bound port."""
        listener = socket.create_server((self._host, self._port))
        listener.settimeout(_ACCEPT_POLL_S)
        self._port = int(listener.getsockname()[1])
        self._accept_thread = threading.Thread(
            target=self._accept_loop,
            args=(listener,),
            name=f"{self._name}-{self._port}",
            daemon=True,
        )
        self._accept_thread.start()
        return self._port

    def stop(self) -> None:
        """Closes the listener and every connection and joins their threads, within a second or
        so; a thread blocked in a send or receive is woken by the socket's shutdown."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=1.0)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            # shutdown wakes a thread blocked in recv/send on this socket; close alone may not.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            thread.join(timeout=0.5)

    def serve_one(self, conn: socket.socket, nonce: bytes) -> bool:
        """Serves one exchange on ``conn``, whose greeting sent ``nonce``; False when the
        connection should close."""
        raise NotImplementedError

    def _accept_loop(self, listener: socket.socket) -> None:
        with listener:
            while not self._stopping.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break
                set_io_timeout(conn, self._io_timeout)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                with self._lock:
                    self._conns[conn] = thread
                thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                nonce = secrets.token_bytes(16)
                conn.sendall(GREETING.pack(GREETING_MAGIC, nonce))
                while not self._stopping.is_set() and self.serve_one(conn, nonce):
                    pass
        except OSError as exc:  # ConnectionError and timeouts included
            logger.debug("%s connection ended: %s", self._name, exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)


class ExchangeError(Exception):
    """An exchange failed; its message is the error as ``"<CODE>: detail"``. ``stale``: the
    connection turned out dead before the peer answered, so a retry on a new one is safe."""

    def __init__(self, error: str, *, stale: bool = False) -> None:
        super().__init__(error)
        self.stale = stale


class KVConnectionPool:
    """Idle reader connections per (host, port), so that many reads share one connection.

    Thread-safe; each connection serves one exchange at a time (`exchange` takes it out of the
    pool and gives it back once the exchange returned). A connection that saw any error or
    refusal is closed, never reused. ``close`` closes the idle ones.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (host, port) -> idle connections, each with its greeting's nonce and the time it was
        # put back, most recent last
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, bytes, float]]] = {}
        self.connects = 0  # connections it opened, for tests and benchmarks

    def take(self, host: str, port: int) -> tuple[socket.socket, bytes] | None:
        """An idle connection to (host, port) that still looks healthy, and its nonce; or None."""
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._idle.get((host, port))
                if not idle:
                    return None
                sock, nonce, since = idle.pop()
            if now - since <= _POOL_MAX_IDLE_S and _looks_idle(sock):
                return sock, nonce
            sock.close()

    def give(self, host: str, port: int, sock: socket.socket, nonce: bytes) -> None:
        """Returns a connection after a successful exchange; closes it when the pool is full."""
        with self._lock:
            idle = self._idle.setdefault((host, port), [])
            if len(idle) < _POOL_MAX_IDLE_PER_PEER:
                idle.append((sock, nonce, time.monotonic()))
                return
        sock.close()

    def exchange(
        self,
        host: str,
        port: int,
        deadline: float,
        run: Callable[[socket.socket, bytes], T],
        *,
        rcvbuf: int | None = None,
    ) -> T | str:
        """``run(sock, nonce)`` on an idle connection to (host, port), else on a new one (see
        `connect`), which comes back to the pool when ``run`` returns and is closed when it
        raises; ``nonce`` is the connection's (its greeting's). Returns
        what ``run`` returned, else the error: ``connect``'s, or an `ExchangeError`'s message. A
        pooled connection that proves stale (the server closed it while it sat idle) is retried
        once on a new one."""
        idle = self.take(host, port)
        if idle is not None:
            try:
                return self._run(host, port, *idle, run)
            except ExchangeError as exc:
                if not exc.stale:
                    return str(exc)
                logger.debug("kv pooled connection to %s:%s was dead, reconnecting", host, port)
        new = connect(host, port, deadline, rcvbuf=rcvbuf)
        if isinstance(new, str):
            return new
        self.connects += 1
        try:
            nonce = _greeting(new, host, port, deadline)
            return self._run(host, port, new, nonce, run)
        except ExchangeError as exc:
            new.close()
            return str(exc)

    def _run(
        self,
        host: str,
        port: int,
        sock: socket.socket,
        nonce: bytes,
        run: Callable[[socket.socket, bytes], T],
    ) -> T:
        try:
            result = run(sock, nonce)
        except BaseException:
            sock.close()
            raise
        self.give(host, port, sock, nonce)
        return result

    def close(self) -> None:
        """Closes every idle connection; the pool stays usable."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for sock, _, _ in conns:
                sock.close()

    def __enter__(self) -> KVConnectionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _greeting(sock: socket.socket, host: str, port: int, deadline: float) -> bytes:
    """The nonce of a new connection's greeting; `ExchangeError` when it does not come."""
    try:
        head = recv_exact(sock, GREETING.size, deadline)
    except OSError as exc:
        code = "DEADLINE" if is_timeout(exc) else "SHORT_READ"
        raise ExchangeError(f"{code}: no greeting from {host}:{port}: {exc}") from None
    if head is None:
        raise ExchangeError(f"SHORT_READ: {host}:{port} closed before its greeting")
    magic, nonce = GREETING.unpack(head)
    if magic != GREETING_MAGIC:
        raise ExchangeError(f"PROTOCOL: {host}:{port} is not a Baton KV server")
    return bytes(nonce)


def _looks_idle(sock: socket.socket) -> bool:
    """True when nothing is readable: no EOF, reset or stray bytes arrived while it sat idle."""
    try:
        return not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"" is EOF
    except BlockingIOError:
        return True
    except OSError:
        return False
