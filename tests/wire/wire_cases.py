"""What several of the wire's test files share: the integer strategies, a frame split
into its header and payload, and one frame read from raw bytes through the real channel."""

from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.transport import FrameChannel

u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)


def split(frame: bytes):
    hdr = wire.decode_header(frame[: wire.HEADER.size])
    payload = frame[wire.HEADER.size :]
    assert hdr.payload_len == len(payload)
    return hdr, payload


class _Bytes:
    """A ByteStream over fixed bytes that records how much the channel asked for."""

    def __init__(self, data: bytes):
        self.data = data
        self.asked = []

    def recv_into(self, view, timeout_s):
        self.asked.append(len(view))
        n = min(len(view), len(self.data))
        view[:n] = self.data[:n]
        self.data = self.data[n:]
        return n

    def sendmsg(self, buffers, deadline=None):
        pass

    def close(self):
        pass


def read_frame(data: bytes):
    """Decode one frame from raw bytes through the real channel (caps included)."""
    hdr, payload = FrameChannel(_Bytes(data)).recv_frame(float("inf"))
    decode = {
        wire.HELLO: lambda: wire.decode_hello(payload),
        wire.HELLO_ACK: lambda: wire.decode_hello_ack(payload),
        wire.ROUND: lambda: wire.decode_round(hdr, payload),
        wire.DRAFTS: lambda: wire.decode_drafts(hdr, payload),
        wire.BYE: lambda: None,
    }[hdr.type]
    return decode()
