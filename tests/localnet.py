"""Loopback helpers for tests that run servers of their own (moto's S3, sshd): 127.0.0.1 only."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 30.0) -> bool:
    """True once something accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.2)
    return False
