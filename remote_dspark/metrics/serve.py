"""A small HTTP server for scrapes that no client can hold: the worker's ``/metrics``,
``/healthz`` and ``/readyz`` (``--metrics-port``) and the engine's exporter
(``VLLM_DSPARK_REMOTE_METRICS_PORT``).

Why not ``http.server`` (or prometheus_client's server, built on it): it gives every
connection a thread from its accept on and bounds a request only by a timeout per read,
so a client that trickles a byte a second never meets it; 24 such clients held all 16
request places of the worker (0 of 96 scrapes answered over 15 s). And it reads up to 100
header lines of 64 KiB each into memory: 16 such requests grew the worker by 100 MiB.

The rules here, each with its reason:

- **Reading a request costs no thread.** One thread and one selector hold the listening
  socket, a wake pipe and every connection whose request head is not whole yet (the
  pending pool): non-blocking sockets, each with a buffer that never passes
  ``max_head_bytes`` + 1.
- **A deadline on the whole request**, not per read: a head not whole
  ``request_timeout_s`` after the accept is answered 408 and closed, however steadily its
  bytes trickle in.
- **Caps before memory:** a head over ``max_head_bytes`` or over ``max_header_lines``
  lines is answered 431 and closed as soon as the cap is passed, before anything more is
  read. A request line that is not ``GET|HEAD TARGET HTTP/1.x`` is 400 (another method
  405). Headers are not parsed at all: no path here needs one.
- **The pool has its own size** (``max_pending``): a newcomer that finds it full pushes
  the oldest connection out. Each turn of the loop reads the pool before it accepts (at
  most half a pool of) new connections, so a request that has arrived is read before
  anything can push it out: slow clients, however many, only push each other out.
- **Only a whole request gets a thread**, at most ``max_answering`` at once, each
  answering one request with a deadline on the whole response (``write_timeout_s``); a
  whole request beyond them is answered 503 at once from the loop. One request per
  connection (``Connection: close``): a kept-alive connection would hold its thread
  between requests.

Memory is bounded by the server's own numbers: ``max_pending`` x ``max_head_bytes``
(512 KiB at the defaults) for the pool, plus ``max_answering`` responses. Nothing here
imports prometheus_client; the paths' answers are the caller's.
"""

from __future__ import annotations

import errno
import http
import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger("remote_dspark.metrics")


@dataclass(frozen=True)
class ScrapeLimits:
    """What one client may cost the server (see the module docstring for each rule)."""

    request_timeout_s: float = 5.0  # from the accept to the whole request head
    write_timeout_s: float = 5.0  # from the answer's start to its last byte sent
    max_head_bytes: int = 8192  # request line and headers, blank line included
    max_header_lines: int = 64  # header lines, the request line not counted
    max_pending: int = 64  # connections whose request is not whole yet
    max_answering: int = 4  # whole requests being answered at once

    def __post_init__(self):
        for name in ("request_timeout_s", "write_timeout_s", "max_head_bytes", "max_header_lines"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} {getattr(self, name)}: must be > 0")
        for name in ("max_pending", "max_answering"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class Answer:
    """What a path answers: an HTTP status, the body's content type, the body."""

    status: int
    content_type: str
    body: bytes


def _text(status: int, message: str) -> Answer:
    return Answer(status, "text/plain; charset=utf-8", (message + "\n").encode())


def response_bytes(answer: Answer, *, with_body: bool = True) -> bytes:
    """The whole HTTP/1.1 response of ``answer`` (``Connection: close``)."""
    head = (
        f"HTTP/1.1 {answer.status} {http.HTTPStatus(answer.status).phrase}\r\n"
        f"Content-Type: {answer.content_type}\r\n"
        f"Content-Length: {len(answer.body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    return head + answer.body if with_body else head


@dataclass(eq=False)
class _HeadPending:
    """A connection whose request head is not whole yet."""

    sock: socket.socket
    deadline: float
    buf: bytearray


class ScrapeServer:
    """Serves ``paths`` (path -> a function that answers it, called on an answering
    thread) on ``host:port`` (0: any free port; :attr:`port` is the bound one) from a
    daemon thread until :meth:`close` (idempotent, bounded). Any other path is 404
    naming the served ones; a query string is ignored.

    Raises:
        OSError: the address cannot be bound (the caller names its flag or variable).
    """

    def __init__(
        self,
        paths: Mapping[str, Callable[[], Answer]],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ScrapeLimits = ScrapeLimits(),
        name: str = "scrape-server",
    ):
        self.paths = dict(paths)
        self.limits = limits
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._pool: OrderedDict[int, _HeadPending] = OrderedDict()  # fd -> pending, oldest first
        self._answering = threading.BoundedSemaphore(limits.max_answering)
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting and drop every pending request (answers under way finish
        within their write deadline, on their own daemon threads)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the loop already ended (it failed, and said so)
            pass
        self._thread.join(timeout_s)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                oldest = next(iter(self._pool.values()), None)
                timeout = None if oldest is None else max(0.0, oldest.deadline - time.monotonic())
                accept = False
                # The pool first, then new connections: a request already here is never
                # pushed out by connections accepted after it in the same turn.
                for key, _ in self._sel.select(timeout):
                    if key.data is not None:
                        self._read(key.data)
                    elif key.fileobj is self._listener:
                        accept = True
                if self._stopping.is_set():
                    break
                if accept:
                    self._accept_some()
                self._expire()
        except Exception:  # a bug here must not pass silently: the server stops answering
            log.exception("%s: the accept loop failed; no more scrapes are answered", self._thread.name)
        finally:
            for p in list(self._pool.values()):
                self._drop(p)
            self._sel.close()
            self._listener.close()
            os.close(self._wake_r)

    def _accept_some(self) -> None:
        for _ in range(max(1, self.limits.max_pending // 2)):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._pool:
                    self._drop(next(iter(self._pool.values())))  # out of descriptors: the oldest makes room
                    continue
                return  # nothing of ours to free; the next readiness tries again
            sock.setblocking(False)
            if len(self._pool) >= self.limits.max_pending:
                self._drop(next(iter(self._pool.values())))
            p = _HeadPending(sock, time.monotonic() + self.limits.request_timeout_s, bytearray())
            self._pool[sock.fileno()] = p
            self._sel.register(sock, selectors.EVENT_READ, p)

    def _read(self, p: _HeadPending) -> None:
        lim = self.limits
        try:
            data = p.sock.recv(lim.max_head_bytes + 1 - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(p)
            return
        start = max(0, len(p.buf) - 2)
        p.buf += data
        end = _head_end(p.buf, start)
        head = p.buf if end < 0 else p.buf[:end]
        header_lines = head.count(b"\n") - (2 if end >= 0 else 1)  # the request line and blank line not counted
        if header_lines > lim.max_header_lines or len(head) > lim.max_head_bytes:
            why = f"request head over {lim.max_header_lines} header lines or {lim.max_head_bytes} bytes"
            self._reply_now(p, _text(431, why))
        elif end >= 0:
            self._request(p, bytes(head))

    def _request(self, p: _HeadPending, head: bytes) -> None:
        """A whole head: the request line judged, then an answering thread or 503."""
        parts = head.split(b"\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._reply_now(p, _text(400, "expected: GET PATH HTTP/1.1"))
            return
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            self._reply_now(p, _text(405, f"{method[:16]}: only GET and HEAD"))
            return
        busy = _text(503, f"busy: {self.limits.max_answering} requests being answered")
        if not self._answering.acquire(blocking=False):
            self._reply_now(p, busy)
            return
        self._remove(p)
        path = target.split("?", 1)[0]
        try:
            threading.Thread(target=self._answer, args=(p.sock, path, method == "GET"), daemon=True).start()
        except RuntimeError:  # no thread to be had now: busy as well
            self._answering.release()
            _send_once_and_close(p.sock, busy)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pool:
            oldest = next(iter(self._pool.values()))
            if oldest.deadline > now:
                return
            self._reply_now(oldest, _text(408, f"request not whole within {self.limits.request_timeout_s:g} s"))

    def _reply_now(self, p: _HeadPending, answer: Answer) -> None:
        """Answer from the loop (:func:`_send_once_and_close`), out of the pool."""
        self._remove(p)
        _send_once_and_close(p.sock, answer)

    def _remove(self, p: _HeadPending) -> None:
        del self._pool[p.sock.fileno()]
        self._sel.unregister(p.sock)

    def _drop(self, p: _HeadPending) -> None:
        self._remove(p)
        p.sock.close()

    # ------------------------------------------------------------------ an answer

    def _answer(self, sock: socket.socket, path: str, with_body: bool) -> None:
        """One whole request's answer, on its own thread, within the write deadline."""
        try:
            deadline = time.monotonic() + self.limits.write_timeout_s
            produce = self.paths.get(path)
            if produce is None:
                answer = _text(404, f"not found; try {', '.join(self.paths)}")
            else:
                try:
                    answer = produce()
                except Exception:
                    log.exception("answering %s failed", path)
                    answer = _text(500, "internal error; see the server's log")
            _send_within(sock, response_bytes(answer, with_body=with_body), deadline)
        finally:
            # The place first: a client that reads to the end and asks again must find it
            # free (closed first, its next request could come before the release: 503).
            self._answering.release()
            sock.close()


def _head_end(buf: bytearray, start: int) -> int:
    """Where the request head in ``buf`` ends (just past its blank line; a bare LF is
    taken for CRLF, as servers do), searching from ``start``; -1 while it has not."""
    ends = [i + len(sep) for sep in (b"\n\r\n", b"\n\n") if (i := buf.find(sep, start)) >= 0]
    return min(ends, default=-1)


def _send_once_and_close(sock: socket.socket, answer: Answer) -> None:
    """At most one non-blocking send of ``answer`` (a short error fits the socket's
    buffer; a client that does not read loses it), then close: the loop never waits."""
    try:
        sock.send(response_bytes(answer))
    except OSError:
        pass
    sock.close()


def _send_within(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Send ``data`` whole before ``deadline``, or give up (the caller closes)."""
    view = memoryview(data)
    try:
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            view = view[sock.send(view) :]
    except OSError:  # timeout included: the client did not read in time
        return
