"""Free loopback ports for the servers the tools and tests start."""
from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(consecutive: int = 1) -> int:
    """A free 127.0.0.1 port whose next ``consecutive - 1`` ports are free too (a server's ingest/track port
    is its port + 1): checked by binding each, so a port another process holds is skipped."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port + consecutive - 1 <= 65535 and all(_bindable(port + k) for k in range(1, consecutive)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
