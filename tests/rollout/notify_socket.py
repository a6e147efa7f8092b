"""A stand-in for systemd's end of sd_notify: a bound AF_UNIX datagram socket that records."""

from __future__ import annotations

import socket
import threading
import time


class NotifySocket:
    """What systemd does: bind a datagram socket and collect what the daemon sends."""

    def __init__(self, address: str) -> None:
        self.address = address
        target = "\0" + address[1:] if address.startswith("@") else address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(target)
        self.sock.settimeout(0.05)
        self.received: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            with self._lock:
                self.received.append((time.monotonic(), data.decode()))

    def messages(self) -> list[str]:
        with self._lock:
            return [m for _, m in self.received]

    def arrivals(self, message: str) -> list[float]:
        with self._lock:
            return [t for t, m in self.received if m == message]

    def wait_for(self, message: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if message in self.messages():
                return
            time.sleep(0.01)
        raise AssertionError(f"no {message!r} within {timeout}s; got {self.messages()!r}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
