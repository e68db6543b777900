"""A request body read straight from a buffer, for object stores whose SDK takes a file
object (boto3)."""

from __future__ import annotations

import os


class ViewBody:
    """A request body read straight from a buffer: ``read`` hands out ``memoryview`` slices
    of it, so neither botocore's payload hash nor the socket send copies the bytes (a
    ``bytes`` body is wrapped in a ``BytesIO`` whose reads copy each chunk, and making one
    from a ``memoryview`` copied the whole object first). Seekable, so botocore can hash
    the payload, learn its length and rewind it to send again.

    Example:
        >>> body = ViewBody(b"abcdef")
        >>> bytes(body.read(4)), bytes(body.read()), body.seek(0, 2), bytes(body.read())
        (b'abcd', b'ef', 6, b'')
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def __len__(self) -> int:
        """Bytes left from the current position (what botocore sends as Content-Length)."""
        return len(self._view) - self._pos

    def __bool__(self) -> bool:
        return True  # an empty body is still a body (botocore tests ``not body``)

    def read(self, size: int | None = -1) -> memoryview:
        start = self._pos
        end = len(self._view) if size is None or size < 0 else min(len(self._view), start + size)
        self._pos = max(start, end)
        return self._view[start : self._pos]

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True
