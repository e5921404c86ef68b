"""Local TCP ports for rendezvous (no torch import: the launcher uses these too)."""

from __future__ import annotations

import socket


def port_is_free(port: int) -> bool:
    """Whether nothing is bound to `port` on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
