"""The scrape server: no client can hold it. A deadline on the whole request, caps on the
request head, no thread until a request is whole, a few answers at once, 503 beyond them."""

from __future__ import annotations

import select
import socket
import threading

import pytest
from helpers import until

from remote_dspark.metrics.serve import Answer, ScrapeLimits, ScrapeServer

OK = Answer(200, "text/plain", b"ok\n")


@pytest.fixture
def serve():
    servers = []

    def make(paths=None, **limits) -> ScrapeServer:
        s = ScrapeServer(paths or {"/metrics": lambda: OK, "/healthz": lambda: OK}, limits=ScrapeLimits(**limits))
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def raw(server: ScrapeServer, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection and read the whole answer (until the server closes)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as c:
        c.sendall(data)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
        return out


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer else 0


def get(server: ScrapeServer, path: str = "/metrics") -> int:
    return status(raw(server, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()))


def test_paths_methods_and_the_request_line(serve):
    s = serve()
    answer = raw(s, b"GET /metrics?name=x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"\r\n\r\nok\n")
    assert b"Content-Length: 3\r\n" in answer and b"Connection: close\r\n" in answer
    head = raw(s, b"HEAD /healthz HTTP/1.0\n\n")  # bare LFs are taken for CRLF
    assert status(head) == 200 and head.endswith(b"\r\n\r\n") and b"Content-Length: 3" in head
    missing = raw(s, b"GET /nope HTTP/1.1\r\n\r\n")
    assert status(missing) == 404 and b"/metrics, /healthz" in missing
    assert status(raw(s, b"POST /metrics HTTP/1.1\r\n\r\n")) == 405
    assert status(raw(s, b"GET /metrics\r\n\r\n")) == 400  # HTTP/0.9: no version
    assert status(raw(s, b"GET /metrics HTTP/2.0\r\n\r\n")) == 400


def test_a_path_that_raises_is_a_500_and_the_server_goes_on(serve):
    def broken():
        raise RuntimeError("a collector's bug")

    s = serve({"/metrics": broken, "/healthz": lambda: OK})
    assert get(s, "/metrics") == 500
    assert get(s, "/healthz") == 200


def test_a_request_trickling_in_meets_the_deadline_on_the_whole_request(serve):
    """A byte every 50 ms resets any per-read timeout; the deadline counts from the accept."""
    s = serve(request_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
        c.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        answer = b""
        for _ in range(400):  # at most 20 s of trickling; the server answers after 0.5 s
            if select.select([c], [], [], 0.05)[0]:
                answer = c.recv(4096)
                break
            c.send(b"a")
        assert status(answer) == 408


@pytest.mark.parametrize(
    "head,expected",
    [
        (b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 64 + b"\r\n", 200),  # exactly the line cap
        (b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 65 + b"\r\n", 431),
        (b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 65, 431),  # refused before the head ends
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (1024 - 30) + b"\r\n\r\n", 200),  # exactly the byte cap
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (1024 - 25), 431),  # one byte over, unfinished
    ],
)
def test_the_request_head_is_capped_in_lines_and_bytes(serve, head, expected):
    s = serve(max_head_bytes=1024, max_header_lines=64)
    assert status(raw(s, head)) == expected
    assert get(s) == 200


def test_slow_clients_beyond_the_pool_only_push_each_other_out(serve):
    """Thirty half-sent requests and a pool of eight: every whole request is answered."""
    s = serve(max_pending=8, max_answering=1)
    slow = []
    try:
        for _ in range(30):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            c.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            slow.append(c)
        assert [get(s, path) for path in ("/metrics", "/healthz") * 5] == [200] * 10
    finally:
        for c in slow:
            c.close()


def test_a_whole_request_beyond_the_answering_places_is_503_at_once(serve):
    gate, entered = threading.Event(), threading.Event()

    def held() -> Answer:
        entered.set()
        gate.wait(10)
        return OK

    s = serve({"/held": held, "/metrics": lambda: OK}, max_answering=1)
    first = threading.Thread(target=lambda: results.append(get(s, "/held")))
    results: list[int] = []
    first.start()
    try:
        assert entered.wait(10)
        assert get(s) == 503
    finally:
        gate.set()
        first.join(15)
    # the place is free again once the first answer's thread is done (it may still be,
    # just after its client has the answer)
    assert results == [200] and until(lambda: get(s) == 200)


def test_close_is_idempotent_and_refuses_new_connections_after(serve):
    s = serve()
    port = s.port
    s.close()
    s.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_port_in_use_is_an_oserror(serve):
    s = serve()
    with pytest.raises(OSError):
        ScrapeServer({"/metrics": lambda: OK}, "127.0.0.1", s.port)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_pending 0"):
        ScrapeLimits(max_pending=0)
    with pytest.raises(ValueError, match="request_timeout_s 0"):
        ScrapeLimits(request_timeout_s=0)
