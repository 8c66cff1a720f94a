"""Endpoints, the TCP transport's deadlines, and the ofl adapter's loader."""

import os
import socket
import textwrap
import threading
import time

import pytest

from remote_dspark import transport, wire
from remote_dspark.transport import DeadlineExceeded, Disconnected, TransportError, parse_endpoint
from remote_dspark.transport.ofl import OflStream


@pytest.mark.parametrize(
    "raw,scheme,host,port,bind",
    [
        ("tcp://127.0.0.1:18620", "tcp", "127.0.0.1", 18620, None),
        ("o1rdma://10.202.28.1:18620?bind=10.202.28.2", "o1rdma", "10.202.28.1", 18620, "10.202.28.2"),
        ("O1TCP://drafter.local:1/", "o1tcp", "drafter.local", 1, None),
        ("tcp://[::1]:65535", "tcp", "::1", 65535, None),
    ],
)
def test_parse_endpoint(raw, scheme, host, port, bind):
    ep = parse_endpoint(raw)
    assert (ep.scheme, ep.host, ep.port, ep.bind) == (scheme, host, port, bind)
    assert parse_endpoint(str(ep)) == ep


@pytest.mark.parametrize(
    "raw,why",
    [
        ("127.0.0.1:18620", "SCHEME://"),
        ("udp://127.0.0.1:1", "unknown scheme 'udp'"),
        ("tcp://:18620", "host"),
        ("tcp://host", "missing :PORT"),
        ("tcp://host:0", "port 0 outside 1..65535"),
        ("tcp://host:65536", "port 65536 outside"),
        ("tcp://host:http", "port 'http' is not a number"),
        ("tcp://host:1?bind=not-an-ip", "not an IPv4 address"),
        ("tcp://host:1?color=red", "unknown option 'color'"),
        ("tcp://[::1:1", "bracketed"),
    ],
)
def test_parse_endpoint_errors_name_variable_and_value(raw, why):
    with pytest.raises(ValueError) as e:
        parse_endpoint(raw)
    assert "VLLM_DSPARK_REMOTE=" in str(e.value) and repr(raw) in str(e.value) and why in str(e.value)


@pytest.fixture
def listener():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    yield s
    s.close()


def test_tcp_deadline_and_disconnect(listener):
    chan = transport.connect(parse_endpoint(f"tcp://127.0.0.1:{listener.getsockname()[1]}"), 1.0)
    peer, _ = listener.accept()
    try:
        assert chan.stream.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with pytest.raises(DeadlineExceeded):
            chan.recv_frame(time.monotonic() + 0.05)
        peer.sendall(wire.encode_bye(7)[:10])  # half a header, then close
        peer.close()
        with pytest.raises(Disconnected):
            chan.recv_frame(time.monotonic() + 1.0)
    finally:
        chan.close()


def test_deadline_mid_frame_resumes_the_same_frame(listener):
    """A reply cut by the deadline is completed by the next read, not lost or misparsed."""
    chan = transport.connect(parse_endpoint(f"tcp://127.0.0.1:{listener.getsockname()[1]}"), 1.0)
    peer, _ = listener.accept()
    try:
        first = wire.encode_drafts(wire.DraftsFrame(1, [0], [2], [0], 2, (7, 8)), 3)
        second = wire.encode_drafts(wire.DraftsFrame(2, [0], [1], [0], 2, (9, 0)), 3)
        for cut in (5, wire.HEADER.size + 3):  # inside the header, inside the payload
            peer.sendall(first[:cut])
            with pytest.raises(DeadlineExceeded):
                chan.recv_frame(time.monotonic() + 0.05)
            peer.sendall(first[cut:] + second)
            hdr, payload = chan.recv_frame(time.monotonic() + 1.0)
            assert wire.decode_drafts(hdr, payload).row(0) == [7, 8]
            hdr, payload = chan.recv_frame(time.monotonic() + 1.0)
            assert wire.decode_drafts(hdr, payload).row(0) == [9]
    finally:
        peer.close()
        chan.close()


def test_the_receive_buffer_grows_as_bytes_arrive_and_the_channel_cap_holds(listener):
    """A header announcing a large payload allocates nothing until the bytes come; a
    large frame that comes in pieces is whole and right; over ``max_payload`` is refused
    on the header; ``frame_timeout_s`` bounds a frame once begun."""
    chan = transport.connect(parse_endpoint(f"tcp://127.0.0.1:{listener.getsockname()[1]}"), 1.0)
    peer, _ = listener.accept()
    try:
        assert chan.stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        payload = bytes(range(256)) * 4096  # 1 MiB
        peer.sendall(wire.encode_header(wire.ROUND, len(payload), 1, 1) + payload[:10])
        with pytest.raises(DeadlineExceeded):
            chan.recv_frame(time.monotonic() + 0.05)
        assert len(chan._buf) < 64 << 10  # nothing allocated for the rest
        sender = threading.Thread(
            target=lambda: [
                peer.sendall(payload[i : i + 65536]) or time.sleep(0.001) for i in range(10, len(payload), 65536)
            ]
        )
        sender.start()
        hdr, got = chan.recv_frame(time.monotonic() + 5)
        sender.join(5)
        assert hdr.payload_len == len(payload) and bytes(got) == payload
        chan.max_payload = 1000
        peer.sendall(wire.encode_header(wire.ROUND, 1001, 1, 2))
        with pytest.raises(wire.ProtocolError, match="ROUND payload of 1001 bytes exceeds this connection's cap 1000"):
            chan.recv_frame(time.monotonic() + 1)
    finally:
        peer.close()
        chan.close()
    chan = transport.connect(parse_endpoint(f"tcp://127.0.0.1:{listener.getsockname()[1]}"), 1.0)
    peer, _ = listener.accept()
    try:
        peer.sendall(wire.encode_header(wire.ROUND, 100, 1, 1) + bytes(10))
        with pytest.raises(DeadlineExceeded):  # no deadline: only the frame's own timeout can end the wait
            chan.recv_frame(float("inf"), frame_timeout_s=0.1)
    finally:
        peer.close()
        chan.close()


def test_tcp_bind_address_is_used(listener):
    chan = transport.connect(parse_endpoint(f"tcp://127.0.0.1:{listener.getsockname()[1]}?bind=127.0.0.2"), 1.0)
    peer, addr = listener.accept()
    try:
        assert addr[0] == "127.0.0.2"
    finally:
        peer.close()
        chan.close()


def test_tcp_connect_refused_is_a_transport_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
        transport.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), 0.5)


def test_sendmsg_sends_memoryviews_whole(listener):
    chan = transport.connect(parse_endpoint(f"tcp://127.0.0.1:{listener.getsockname()[1]}"), 1.0)
    peer, _ = listener.accept()
    try:
        big = bytearray(b"r" * (4 << 20))
        got = bytearray()

        def read():
            peer.settimeout(5)
            while len(got) < len(big) + 8:
                chunk = peer.recv(1 << 20)
                if not chunk:
                    return
                got.extend(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        chan.send(b"head", memoryview(big), b"", b"tail")
        reader.join(10)
        assert got == b"head" + big + b"tail"
    finally:
        peer.close()
        chan.close()


STAND_IN_OFL = textwrap.dedent("""
    import socket
    calls = []

    class Conn:
        def __init__(self, sock):
            self.sock = sock
        def sendmsg(self, buffers, deadline=None):
            for b in buffers:
                self.sock.sendall(b)
        def recv_into(self, view, timeout_s):
            self.sock.settimeout(timeout_s)
            return self.sock.recv_into(view)
        def close(self):
            self.sock.close()

    def connect(host, port, *, mode, bind, timeout_s, lib):
        calls.append((host, port, mode, bind, lib))
        return Conn(socket.create_connection((host, port), timeout=timeout_s))
""")


def test_ofl_adapter_loads_stand_in_and_carries_frames(tmp_path, listener):
    (tmp_path / "ofl.py").write_text(STAND_IN_OFL)
    (tmp_path / "libofl.so").write_bytes(b"")
    env = {"VLLM_DSPARK_REMOTE_OFL_DIR": str(tmp_path)}
    ep = parse_endpoint(f"o1rdma://127.0.0.1:{listener.getsockname()[1]}")
    transport.check_ready(ep, env)
    chan = transport.connect(ep, 1.0, env)
    peer, _ = listener.accept()
    try:
        module = transport.ofl.load_ofl(str(tmp_path))
        assert module.calls == [("127.0.0.1", ep.port, "rdma", None, str(tmp_path / "libofl.so"))]
        peer.sendall(wire.encode_bye(5))
        hdr, _ = chan.recv_frame(time.monotonic() + 1.0)
        assert (hdr.type, hdr.session) == (wire.BYE, 5)
    finally:
        peer.close()
        chan.close()


def test_ofl_adapter_hands_the_library_no_empty_buffer():
    """An engine without rows sends an empty rows part: the ofl library never sees it."""
    got = []

    class Conn:
        def sendmsg(self, buffers):
            got.append([bytes(b) for b in buffers])

    rows = memoryview(bytearray(8))[:0]
    OflStream(Conn()).sendmsg([b"head", memoryview(b"block"), rows])
    assert got == [[b"head", b"block"]]


@pytest.mark.parametrize(
    "files,why",
    [
        (None, "is not set"),
        ("nodir", "not a directory"),
        ((), "missing ofl.py and libofl.so"),
        (("ofl.py",), "missing libofl.so"),
        (("libofl.so",), "missing ofl.py"),
    ],
)
def test_ofl_missing_pieces_fail_at_start_naming_the_variable(tmp_path, files, why):
    if files is None:
        env = {}
    elif files == "nodir":
        env = {"VLLM_DSPARK_REMOTE_OFL_DIR": str(tmp_path / "absent")}
    else:
        for f in files:
            (tmp_path / f).write_text(STAND_IN_OFL if f == "ofl.py" else "")
        env = {"VLLM_DSPARK_REMOTE_OFL_DIR": str(tmp_path)}
    with pytest.raises(ValueError) as e:
        transport.check_ready(parse_endpoint("o1tcp://127.0.0.1:1"), env)
    assert "VLLM_DSPARK_REMOTE_OFL_DIR" in str(e.value) and why in str(e.value)


def test_ofl_module_without_connect_is_refused(tmp_path):
    (tmp_path / "ofl.py").write_text("x = 1\n")
    (tmp_path / "libofl.so").write_bytes(b"")
    with pytest.raises(ValueError, match="VLLM_DSPARK_REMOTE_OFL_DIR=.*no connect"):
        transport.check_ready(parse_endpoint("o1tcp://127.0.0.1:1"), {"VLLM_DSPARK_REMOTE_OFL_DIR": str(tmp_path)})


@pytest.mark.parametrize("target", ["dir", "ofl.py", "libofl.so"])
def test_ofl_code_others_may_write_is_never_imported(tmp_path, target):
    """A directory or file of OFL_DIR that others may write could hold anyone's code:
    refused before ofl.py runs, naming the variable and the culprit."""
    ofl = tmp_path / "ofl"
    ofl.mkdir(mode=0o755)
    ran = tmp_path / "ran"
    (ofl / "ofl.py").write_text(f"open({str(ran)!r}, 'w').close()\n" + STAND_IN_OFL)
    (ofl / "libofl.so").write_bytes(b"")
    os.chmod(ofl if target == "dir" else ofl / target, 0o777 if target == "dir" else 0o666)
    with pytest.raises(ValueError, match=r"VLLM_DSPARK_REMOTE_OFL_DIR=.*refusing to load .*written by others"):
        transport.ofl.load_ofl(str(ofl))
    assert not ran.exists()
    os.chmod(ofl, 0o755)
    for f in ("ofl.py", "libofl.so"):
        os.chmod(ofl / f, 0o644)
    transport.ofl.load_ofl(str(ofl))  # the same files, trusted now: loaded
    assert ran.exists()


def test_an_ofl_module_that_is_a_link_is_refused(tmp_path):
    real = tmp_path / "elsewhere.py"
    real.write_text(STAND_IN_OFL)
    ofl = tmp_path / "ofl"
    ofl.mkdir()
    (ofl / "ofl.py").symlink_to(real)
    (ofl / "libofl.so").write_bytes(b"")
    with pytest.raises(ValueError, match="ofl.py.*not a regular file"):
        transport.ofl.load_ofl(str(ofl))
