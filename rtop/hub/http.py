"""The little HTTP the hub speaks on its one port: ``GET /metrics`` for Prometheus.

A connection whose first bytes are ``GET `` or ``HEAD`` is HTTP (:func:`starts_request`).
Its request head (request line and headers) must arrive whole within the hub's
deadline and within :data:`HTTP_MAX_BYTES` (:func:`parse_head`); the hub answers once
(:func:`response`) and closes the connection. What the hub answers, and to which token,
is the hub's (:mod:`rtop.hub.server`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The most bytes of an HTTP request's head (request line and headers).
HTTP_MAX_BYTES = 8192


class RequestTooLarge(ValueError):
    """An HTTP request's head is longer than :data:`HTTP_MAX_BYTES`."""


@dataclass(frozen=True)
class Request:
    """An HTTP request's head, as far as the hub reads it."""

    path: str  # without its query
    bearer: bytes  # the token of an ``Authorization: Bearer`` header; b"" without one


def starts_request(data: bytes) -> bool:
    """Whether the first bytes a peer sent begin an HTTP request the hub serves."""
    return data[:4] in (b"GET ", b"HEAD")


def parse_head(buf: bytes) -> Request | None:
    """The request whose head ``buf`` starts with; None while the head is not whole.
    Raises :class:`RequestTooLarge` once it cannot fit :data:`HTTP_MAX_BYTES`."""
    if b"\r\n\r\n" not in buf:
        if len(buf) > HTTP_MAX_BYTES:
            raise RequestTooLarge(f"{len(buf)} bytes without the end of a request head")
        return None
    head = buf.split(b"\r\n\r\n", 1)[0]
    if len(head) > HTTP_MAX_BYTES:
        raise RequestTooLarge(f"a request head of {len(head)} bytes")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    path = (parts[1] if len(parts) > 1 else "/").split("?", 1)[0]
    auth_header = ""
    for line in lines[1:]:
        if line.lower().startswith("authorization:"):
            auth_header = line.split(":", 1)[1].strip()
    bearer = (auth_header[7:] if auth_header.lower().startswith("bearer ") else "").encode()
    return Request(path=path, bearer=bearer)


def response(status: str, body: bytes = b"", content_type: str | None = None) -> bytes:
    """A whole response (``status`` as ``"200 OK"``), after which the hub closes the
    connection."""
    kind = f"Content-Type: {content_type}\r\n" if content_type is not None else ""
    return (f"HTTP/1.1 {status}\r\n{kind}Content-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body
