"""A TCP proxy on 127.0.0.1 that adds a fixed latency to every request (``kuat bench``'s remote
workload puts it in front of the S3-compatible server to play a far-away object store).

Each client connection gets its own upstream connection to ``target``; bytes are forwarded
unchanged both ways. A *request* is the first burst of client bytes after the connection opened
or after the server last answered on it (HTTP/1.1 keep-alive: request, response, request, ...);
the proxy holds each request ``delay_s`` before forwarding it, so every GET, HEAD or ranged read
pays ``delay_s`` once, as a round trip to a distant region does, however many requests are in
flight on other connections. Bandwidth is not limited.

Loopback only: it listens on 127.0.0.1 and refuses a target that is not a loopback address.
Threads: one accept thread, two per connection (daemons); :meth:`DelayProxy.close` stops
accepting and closes every connection. Not a test of anything: a benchmark fixture.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time

log = logging.getLogger("kuat.bench.delay_proxy")

_ACCEPT_POLL_S = 0.2  # how soon close() is noticed by the accept loop (a socket timeout)
_CHUNK = 1 << 16


class DelayProxy:
    """Forward ``127.0.0.1:port`` to ``target``, each request held ``delay_s`` seconds.

    Args:
        target: ``(host, port)`` of the server; the host must be a loopback address.
        delay_s: seconds added to every request (>= 0).
        port: port to listen on (0: a free one; read :attr:`port` after :meth:`start`).

    Attributes:
        requests: requests forwarded so far (all connections).
        connections: client connections accepted so far.

    Use as a context manager or ``start()`` / ``close()``.

    Raises:
        ValueError: ``delay_s`` is negative or ``target`` is not a loopback address.
    """

    def __init__(self, target: tuple[str, int], delay_s: float, port: int = 0):
        if delay_s < 0:
            raise ValueError(f"delay_s={delay_s!r} must be >= 0")
        host = "127.0.0.1" if target[0] == "localhost" else target[0]
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"target={target!r}: the proxy only forwards to loopback")
        self.target = (host, int(target[1]))
        self.delay_s = float(delay_s)
        self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind(("127.0.0.1", port))
        self.port = self._listen.getsockname()[1]
        self.requests = 0
        self.connections = 0
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DelayProxy:
        self._listen.listen(64)
        self._listen.settimeout(_ACCEPT_POLL_S)
        self._thread = threading.Thread(target=self._accept, name="delay-proxy", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and close every open connection. Idempotent."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * _ACCEPT_POLL_S)
        self._listen.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _close(s)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listen.accept()
            except TimeoutError:
                continue
            except OSError:  # closed under us
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError as e:
                log.warning("delay proxy: cannot reach %s:%d: %s", *self.target, e)
                _close(client)
                continue
            upstream.settimeout(None)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.connections += 1
                self._socks.update((client, upstream))
            # answered: the server has sent bytes since the client's last request began
            state = {"answered": True}
            threading.Thread(
                target=self._pump, args=(client, upstream, state, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, state, False), daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, state: dict, requests: bool) -> None:
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                if requests:
                    if state["answered"]:  # a new request: the simulated round trip
                        state["answered"] = False
                        with self._lock:
                            self.requests += 1
                        if self.delay_s:
                            time.sleep(self.delay_s)  # the latency being simulated
                else:
                    state["answered"] = True
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)
            with self._lock:
                self._socks.difference_update((src, dst))


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
