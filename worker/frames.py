"""Frames over a pipe (the worker <-> writer process link, no pickle): a 4-byte little-endian
length, then the body."""

from __future__ import annotations

import os
import select
import struct

_HEADER = struct.Struct("<I")
PIPE_BYTES = 1 << 20  # ~80 steps of 256 jobs' events before a submit would block


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


class Frames:
    """Length-prefixed frames off a pipe."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def take(self) -> list[bytes]:
        """Wait for at least one whole frame, then return every whole frame read; [] at the
        end of the input."""
        while True:
            frames = self._split()
            if frames:
                return frames
            chunk = os.read(self.fd, PIPE_BYTES)
            if not chunk:
                return []
            self.buf += chunk

    def ready(self, timeout: float) -> bool:
        """Whether a read would not block, waiting up to `timeout` seconds."""
        return bool(self._poller.poll(timeout * 1000))

    def take_ready(self) -> list[bytes] | None:
        """Every whole frame that can be read without blocking (maybe none); None at the end
        of the input."""
        while self.ready(0):
            chunk = os.read(self.fd, PIPE_BYTES)
            if not chunk:
                return self._split() or None
            self.buf += chunk
        return self._split()

    def _split(self) -> list[bytes]:
        frames, offset, buf = [], 0, self.buf
        while len(buf) - offset >= 4:
            (size,) = _HEADER.unpack_from(buf, offset)
            if len(buf) - offset - 4 < size:
                break
            frames.append(bytes(buf[offset + 4:offset + 4 + size]))
            offset += 4 + size
        if offset:
            del buf[:offset]
        return frames
