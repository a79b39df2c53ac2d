"""A TCP proxy on the loopback interface that injects network faults in front of a server:
it cuts connections in the middle of a response or of a request body (a reset, as a
dropped link looks to the client) and delays responses. The faults are bounded (a count
of each, then the proxy passes bytes through untouched), and the proxy stops by itself
after ``lifetime`` seconds, whatever the test does.

>>> proxy = FaultProxy(upstream_port, cut_responses=2, cut_after=100_000)  # doctest: +SKIP
>>> proxy.endpoint, proxy.cut                                               # doctest: +SKIP
('http://127.0.0.1:40123', 0)
"""

import socket
import ssl
import struct
import threading
import time

_CHUNK = 64 << 10


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``.

    - ``cut_responses``: that many connections are reset once more than ``cut_after``
      bytes of response have passed on them (mid-body of a large GET);
    - ``cut_requests``: that many connections are reset once more than ``cut_after``
      bytes of request have passed on them (mid-body of an uploaded part);
    - ``delays``: that many responses wait ``delay`` seconds before their first byte;
    - ``spare``: (with ``cut_requests``) instead, the connection is cut that carries the
      request byte number ``spare`` counted over all connections (to cut a later request of
      a sequence, whatever connections the client reuses).

    ``cut``, ``delayed`` count the faults injected so far; ``responded``, the response
    bytes passed on to clients in all. With ``tls=(certificate, key)`` (PEM files), clients
    speak TLS to the proxy (``https://``), which passes plain bytes upstream.
    """

    def __init__(self, upstream_port, *, cut_responses=0, cut_requests=0, cut_after=64 << 10,
                 delays=0, delay=0.5, spare=0, lifetime=120.0, tls=None):
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.spare = spare
        self.requested = 0  # request bytes passed in all
        self.responded = 0  # response bytes passed in all
        self.delay = delay
        self._budget = {"response": cut_responses, "request": cut_requests, "delay": delays}
        self.cut = 0
        self.delayed = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sockets = set()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._listener = context.wrap_socket(self._listener, server_side=True)
        self._deadline = time.monotonic() + lifetime
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def _take(self, kind):
        """Whether one more fault of ``kind`` may be injected (and counts it)."""
        with self._lock:
            if self._budget[kind] <= 0:
                return False
            self._budget[kind] -= 1
            if kind == "delay":
                self.delayed += 1
            else:
                self.cut += 1
            return True

    def _accept(self):
        try:
            while not self._closed.is_set() and time.monotonic() < self._deadline:
                try:
                    client, _ = self._listener.accept()
                except (socket.timeout, ssl.SSLError):  # a TLS handshake the client gave up
                    continue
                except OSError:
                    break
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                except OSError:
                    _reset(client)
                    continue
                upstream.settimeout(None)
                with self._lock:
                    self._sockets.update((client, upstream))
                link = _Link(self, client, upstream)
                threading.Thread(target=link.pump, args=("request",), daemon=True).start()
                threading.Thread(target=link.pump, args=("response",), daemon=True).start()
        finally:
            self.close()

    def close(self):
        """Stops accepting and resets every connection still open."""
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            _reset(s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Link:
    """One client connection and its upstream connection."""

    def __init__(self, proxy, client, upstream):
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.passed = {"request": 0, "response": 0}
        # A request went up since the last response bytes came down: the next response
        # bytes begin a response.
        self.awaiting_response = False
        self.done = False

    def pump(self, direction):
        src, dst = (self.client, self.upstream) if direction == "request" else (self.upstream, self.client)
        proxy = self.proxy
        try:
            while not self.done:
                data = src.recv(_CHUNK)
                if not data:
                    break
                crossed = False
                if direction == "request":
                    self.awaiting_response = True
                    with proxy._lock:
                        crossed = proxy.requested < proxy.spare <= proxy.requested + len(data)
                        proxy.requested += len(data)
                elif self.awaiting_response:
                    self.awaiting_response = False
                    if proxy._take("delay"):
                        time.sleep(proxy.delay)
                before = self.passed[direction]
                self.passed[direction] += len(data)
                if proxy.spare and direction == "request":
                    at = proxy.spare - (proxy.requested - len(data)) if crossed else None
                else:
                    at = proxy.cut_after - before if before <= proxy.cut_after < self.passed[direction] else None
                if at is not None and proxy._take(direction):
                    # Half of what crossed the line goes through, then the link drops.
                    dst.sendall(data[: max(1, at // 2)])
                    self.close()
                    return
                dst.sendall(data)
                if direction == "response":
                    with proxy._lock:
                        proxy.responded += len(data)
        except OSError:
            pass
        self.close()

    def close(self):
        self.done = True
        for s in (self.client, self.upstream):
            _reset(s)
        with self.proxy._lock:
            self.proxy._sockets.difference_update((self.client, self.upstream))


def _reset(sock):
    """Closes ``sock`` with a reset (no orderly shutdown), as a dropped link looks; a
    thread blocked reading it wakes up."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
