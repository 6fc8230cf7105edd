"""A server under measurement: a process of its own on a free loopback port, up once its health
endpoint answers, stopped by its process id when left (bench-serve, its chat workload and the
soak).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from ..errors import GenerationError


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
