"""Small network helpers every layer uses: a free TCP port to give a server it is about to start.

>>> 0 < free_port() < 65536
True
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (the OS picks it; another process may still take it
    before the server that is given it binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
