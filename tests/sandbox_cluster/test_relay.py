"""The relay and the demux of `sandbox.cluster.relay`, on loopback sockets: a connection reaches the sandbox
listener as its sandbox's own address only when the node's relay knows its source and the gateway's demux
checks the relay's word; anything else is closed before a byte reaches the listener."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from core.net import free_port
from sandbox.cluster.relay import Demux, Relay, preamble

SECRET = b"s" * 32


class Listener:
    """A stand-in for the sandbox listener: answers each connection with the address it came from."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(10)
        self.port = self.sock.getsockname()[1]
        self.seen: list[str] = []

    def answer_one(self) -> None:
        conn, peer = self.sock.accept()
        with conn:
            data = conn.recv(100)
            self.seen.append(peer[0])
            conn.sendall(peer[0].encode() + b" " + data)


@pytest.fixture
def listener() -> Iterator[Listener]:
    made = Listener()
    yield made
    made.sock.close()


@pytest.fixture
def demux(listener: Listener) -> Iterator[Demux]:
    made = Demux("127.0.0.1", ("127.0.0.1", listener.port), SECRET, {"box-1": "127.77.0.1"}.get)
    yield made
    made.stop()


def exchange(address: tuple[str, int], data: bytes, source: str = "127.0.0.1") -> bytes:
    with socket.create_connection(address, timeout=10, source_address=(source, 0)) as conn:
        conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := conn.recv(100):
            chunks.append(chunk)
        return b"".join(chunks)


def test_the_demux_lets_a_vouched_for_sandbox_through_from_its_own_address(
    listener: Listener, demux: Demux
) -> None:
    answer = threading.Thread(target=listener.answer_one)
    answer.start()
    assert exchange(demux.address, preamble(SECRET, "box-1") + b"GET /") == b"127.77.0.1 GET /"
    answer.join()
    for forged in (preamble(b"x" * 32, "box-1"), preamble(SECRET, "box-2"), b"GET / HTTP/1.1\r\n"):
        assert exchange(demux.address, forged + b"GET /") == b""  # closed, and the listener saw nothing
    assert listener.seen == ["127.77.0.1"]


def test_the_relay_vouches_only_for_the_sandboxes_of_its_node(listener: Listener, demux: Demux) -> None:
    port = free_port()
    relay = Relay("127.0.0.1", port, demux.address, SECRET, {"127.0.0.9": "box-1"}.get)
    try:
        answer = threading.Thread(target=listener.answer_one)
        answer.start()
        assert exchange(("127.0.0.1", port), b"hello", source="127.0.0.9") == b"127.77.0.1 hello"
        answer.join()
        assert exchange(("127.0.0.1", port), b"hello", source="127.0.0.10") == b""  # no sandbox of its
        wrong_key = Relay("127.0.0.1", free_port(), demux.address, b"k" * 32, {"127.0.0.9": "box-1"}.get)
        try:  # a relay the gateway never gave its secret
            assert (
                exchange(("127.0.0.1", wrong_key.server.sockets[0].getsockname()[1]), b"hi", "127.0.0.9")
                == b""
            )
        finally:
            wrong_key.stop()
        assert listener.seen == ["127.77.0.1"]
    finally:
        relay.stop()
