"""The node's `Relay` of `sandbox.cluster.relay`, on loopback sockets, before a stand-in for the gateway's
sandbox listener that challenges each connection and says what the relay's answer vouched for: the relay
answers only for the sandboxes of its node, with its node's key, and holds at most ``each`` connections
per sandbox (the listener's own side is tested in ``tests/gateway/test_doors_sandbox_identity.py``)."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from core.net import free_port
from sandbox.cluster.relay import Relay, challenge, check, node_key, vouch

MASTER = b"m" * 32
NODE = "10.1.0.3"


class Listener:
    """A stand-in for the sandbox listener: challenges each connection, reads the answer line, and sends
    back what `check` makes of it (``none`` when nothing), then echoes one chunk and closes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(30)
        self.address = self.sock.getsockname()[:2]
        self.lines: list[bytes] = []

    def answer(self, count: int = 1) -> threading.Thread:
        """Serve the next `count` connections, each in a thread of its own; the returned thread ends
        when all of them have."""

        def one(conn: socket.socket) -> None:
            with conn:
                asked = challenge()
                conn.sendall(asked)
                line = b""
                while not line.endswith(b"\n"):
                    line += conn.recv(1)
                self.lines.append(line)
                vouched = check(MASTER, asked, line)
                conn.sendall(f"{vouched}|".encode() + conn.recv(100))

        def serve() -> None:
            threads = []
            for _ in range(count):
                threads.append(threading.Thread(target=one, args=(self.sock.accept()[0],)))
                threads[-1].start()
            for thread in threads:
                thread.join()

        thread = threading.Thread(target=serve)
        thread.start()
        return thread


@pytest.fixture
def listener() -> Iterator[Listener]:
    made = Listener()
    yield made
    made.sock.close()


@pytest.fixture
def relay(listener: Listener) -> Iterator[Relay]:
    made = Relay(
        "127.0.0.1",
        free_port(),
        listener.address,
        NODE,
        node_key(MASTER, NODE),
        {"127.0.0.9": "box-1"}.get,
        each=2,
    )
    yield made
    made.stop()


def wait_for(condition: Callable[[], bool], deadline_s: float = 30.0) -> None:
    """Until `condition` holds (a deadline, not a duration: it returns as soon as it does)."""
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, "the condition never held"
        time.sleep(0.01)


def exchange(port: int, data: bytes, source: str) -> bytes:
    """Send `data` from `source`, then read until the relay closes: what came back. A connection the relay
    closed at once (a refusal) may be reset before the send or the read ends: it answered nothing more."""
    chunks = []
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as conn:
        try:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(100):
                chunks.append(chunk)
        except OSError as e:
            if e.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN):
                raise
    return b"".join(chunks)


def test_the_relay_vouches_as_its_node_for_the_sandbox_at_the_source_address_only(
    listener: Listener, relay: Relay
) -> None:
    served = listener.answer()
    assert exchange(relay.server_port, b"hello", "127.0.0.9") == b"('10.1.0.3', 'box-1')|hello"
    served.join()
    assert exchange(relay.server_port, b"hello", "127.0.0.10") == b""  # no sandbox of its node
    assert len(listener.lines) == 1  # the gateway never heard of the second
    wrong = Relay(
        "127.0.0.1", free_port(), listener.address, NODE, node_key(b"k" * 32, NODE), {"127.0.0.9": "b"}.get
    )
    try:  # a relay with a key the gateway did not give it: the gateway refuses its word
        served = listener.answer()
        assert exchange(wrong.server_port, b"hi", "127.0.0.9") == b"None|hi"
        served.join()
    finally:
        wrong.stop()


def test_a_vouch_is_bound_to_its_challenge_its_node_and_its_key() -> None:
    key = node_key(MASTER, NODE)
    asked = challenge()
    answer = vouch(key, NODE, "box-1", asked)
    assert answer is not None and check(MASTER, asked, answer) == (NODE, "box-1")
    assert challenge() != asked
    assert [check(MASTER, challenge(), answer) for _ in range(3)] == [None] * 3  # replayed: a new nonce each
    other = node_key(MASTER, "10.1.0.4")
    assert check(MASTER, asked, vouch(other, "10.1.0.4", "box-1", asked) or b"") == ("10.1.0.4", "box-1")
    assert check(MASTER, asked, vouch(other, NODE, "box-1", asked) or b"") is None  # another node's key
    assert vouch(key, NODE, "box é", asked) is None and vouch(key, NODE, "box-1", b"GET /\n") is None
    for line in (b"BELAYER 10.1.0.3 box-\xc3\xa9 " + b"0" * 64, b"\xff" * 300, b"", b"BELAYER a b c d e"):
        assert check(MASTER, asked, line) is None


def test_the_relay_holds_at_most_each_connections_per_sandbox(listener: Listener, relay: Relay) -> None:
    """Two connections of sandbox box-1 are relayed (held open by the stand-in, which waits for their
    bytes); a third is closed at once, before the gateway hears of it; once one ends, a new one passes."""
    served = listener.answer(3)
    source = ("127.0.0.9", 0)
    held = [socket.create_connection(("127.0.0.1", relay.server_port), 30, source) for _ in range(2)]
    try:
        wait_for(lambda: dict(relay.held) == {"box-1": 2})
        assert exchange(relay.server_port, b"third", "127.0.0.9") == b""
        for i, conn in enumerate(held):
            conn.sendall(b"held%d" % i)
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(100).endswith(b"|held%d" % i)
        assert exchange(relay.server_port, b"again", "127.0.0.9").endswith(b"|again")
        served.join()
        assert len(listener.lines) == 3
    finally:
        for conn in held:
            conn.close()
