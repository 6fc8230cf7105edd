"""A server under measurement: a process of its own on a free loopback port, up once its health
endpoint answers, stopped by its process id when left (bench-serve, its chat workload and the
soak); a load run on it (`measure_server`) and its /metrics read (`metric`).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from ..errors import GenerationError
from .serve_load import LoadRequest, run_chat_load, run_load


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer(NamedTuple):
    url: str
    pid: int


@contextmanager
def server_process(
    command: list[str], threads: int | None, timeout_s: float = 900, health: str = "/health"
) -> Iterator[RunningServer]:
    """`command` listening on a free loopback port (`--port` added) with `threads` OpenMP threads
    (the machine's default where None), running until left; yields its URL and process id once
    `health` answers.
    Where it fails to come up, its whole log is kept (the error names the file): a compiler's
    traceback is longer than any tail, and the line naming the graph it was building comes first."""
    import httpx

    port = free_port()
    command = [*command, "--port", str(port)]  # the last --port wins
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(mode="w+", prefix="staticrt-serve-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    failed = False
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                failed = True
                log.seek(0)
                tail = log.read()[-2000:]
                why = f"exited with {process.returncode}" if process.poll() is not None else f"not up in {timeout_s} s"
                raise GenerationError(f"{' '.join(command[:4])} ... {why} (its whole log: {log.name}):\n{tail}")
            try:
                if httpx.get(f"{url}{health}", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield RunningServer(url, process.pid)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            failed = True  # a server that ignores SIGTERM is a defect: its log is kept to find it
            logging.getLogger("staticrt").warning(
                "%s did not stop within 60 s of SIGTERM and was killed; its whole log: %s", command[0], log.name
            )
        log.close()
        if not failed:
            os.unlink(log.name)


def measure_server(command: list[str], model: str, request: Any, load: Any, health: str = "/health") -> dict[str, Any]:
    """The load on the server `command` starts (`request`: a `ServeBenchRequest`): `load` a list of
    requests, or a chat workload's (system prompt, conversations); after one warm-up request, so
    first-use costs stay out."""
    with server_process(command, request.threads, health=health) as (url, _):
        if isinstance(load, tuple):
            system, conversations = load
            run_load(url, model, [LoadRequest("warm-up", 4)], 1, request.duration_s)  # shares no prefix
            return run_chat_load(url, model, system, conversations, request.duration_s)
        run_load(url, model, load[:1], 1, request.duration_s)
        return run_load(url, model, load, request.concurrency, request.duration_s)


def metric(url: str, name: str) -> float:
    """One sample of the server's /metrics."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))
