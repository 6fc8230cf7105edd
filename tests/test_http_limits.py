"""Slow senders at the HTTP level (issue 68): a connection that sends nothing, or trickles its
request's headers, is closed when HEADERS_S runs out, however often a byte arrives; a body that
trickles gets 408 when BODY_S runs out; the server serves a plain request meanwhile and after. On
both of uvicorn's HTTP implementations (h11; httptools, which uvicorn picks where installed)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

import staticrt

pytest.importorskip("fastapi", reason="serving needs the serve extra: use the README's test command")

from serving import running  # noqa: E402

from staticrt.serve import http_limits, serve_backend  # noqa: E402

MODEL = "tiny-llama"
LIMIT_S = 1.0  # the limits, shortened for the test


@pytest.fixture(params=["h11", "httptools"])
def server(request, monkeypatch):
    if request.param == "httptools":
        pytest.importorskip("httptools", reason="uvicorn uses httptools only where it is installed")
    import staticrt.serve as serve

    chosen = http_limits._h11 if request.param == "h11" else http_limits.protocol_class
    monkeypatch.setattr(serve, "protocol_class", chosen)
    monkeypatch.setattr(http_limits, "HEADERS_S", LIMIT_S)
    monkeypatch.setattr(http_limits, "BODY_S", LIMIT_S)
    gen = staticrt.Generator(staticrt.load_model(MODEL), max_batch_size=1, max_cache_len=32)
    app, _ = serve_backend(gen.backend, name=MODEL)
    with running(app) as url:
        yield url, request.param


def _closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the server closes `sock`, sending it `trickle` a byte every 0.1 s meanwhile."""
    start, sent = time.monotonic(), 0
    sock.settimeout(0.1)
    while time.monotonic() - start < 5 * LIMIT_S:
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent : sent + 1])
            except OSError:
                return time.monotonic() - start
            sent += 1
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    return float("inf")


def _plain(url: str) -> int:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2}).status_code


def test_silent_and_trickling_connections_are_closed_at_the_header_limit(server):
    url, kind = server
    port = int(url.rsplit(":", 1)[1])
    silent = socket.create_connection(("127.0.0.1", port))
    assert _plain(url) == 200  # served while a connection hangs on
    trickling = socket.create_connection(("127.0.0.1", port))  # its limit runs from here
    header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    assert LIMIT_S * 0.8 < _closed_after(trickling, header) < LIMIT_S + 1.5, kind
    assert _closed_after(silent) < 1.5, kind  # its limit ran while the other was timed
    # after a whole request, a second one's trickled headers get the same limit
    again = socket.create_connection(("127.0.0.1", port))
    again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in again.recv(4096)
    assert LIMIT_S * 0.8 < _closed_after(again, b"GET /health HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 200) < 5
    assert _plain(url) == 200


def test_a_trickling_body_gets_408_at_the_body_limit_and_the_server_serves_after(server):
    url, kind = server
    port = int(url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    sock.sendall(b"Content-Length: 500\r\n\r\n{")
    sock.settimeout(LIMIT_S + 3)
    start, answer = time.monotonic(), b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408 "), (kind, answer[:80])
    assert LIMIT_S * 0.8 < time.monotonic() - start < LIMIT_S + 2
    assert _plain(url) == 200
