"""The soak through `staticrt serve --replicas N` on Ray with a replica killed every few minutes
(issue 68): what the server is (the serve process and every process under it: Ray's GCS, raylet,
the ingress and the replicas), what it holds (the ingress's open requests), the kills (SIGKILL to
the live replica holding the most requests, what it held and streamed then), and the verdict on
them: the streams the clients saw lost beside those the killed replicas were streaming, the
requests sent again, and how soon after each kill the answers came back to their rate before it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .server_process import metric

RECOVERY_WINDOW_S = 10.0  # answers are counted in windows this long
RECOVERED = 0.8  # of the rate in the minute before a kill: the first window after it that reaches this


def _descendants(pid: int) -> list[int]:
    """`pid` and every process under it, from /proc's children lists."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:  # gone meanwhile
                pass
    return found


def tree_sample(pid: int) -> dict[str, float]:
    """Resident memory (MB), descriptors and threads summed over `pid` and the processes under it."""
    rss_kb = fds = threads = 0
    for process in _descendants(pid):
        try:
            status = Path(f"/proc/{process}/status").read_text()
            fds += len(os.listdir(f"/proc/{process}/fd"))
        except OSError:  # gone meanwhile (a killed replica)
            continue
        rss_kb += int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1)) if "VmRSS" in status else 0
        threads += int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    return {"rss_mb": rss_kb / 1024, "fds": fds, "threads": threads}


def ray_probe(url: str, pid: int) -> dict[str, float]:
    """A sample of the Ray server: its process tree's numbers, and as busy rows the requests the
    ingress holds open (its replicas' rows and queues are behind it)."""
    import httpx

    health = httpx.get(f"{url}/health", timeout=30).json()
    return {**tree_sample(pid), "pool_mb": 0.0, "busy_rows": health["open_requests"], "queue": 0}


def _pid(replica: str) -> int:
    """A replica's process id, from the name the ingress knows it by ("... (pid N)")."""
    return int(re.search(r"\(pid (\d+)\)", replica).group(1))


class ReplicaKiller(threading.Thread):
    """Every `every_s` seconds until `stop`, SIGKILL to the live replica holding the most requests
    (the ingress's /health); each kill is recorded with what that replica held and streamed."""

    def __init__(self, url: str, every_s: float, start: float, until: float) -> None:
        """Kills from `start` + `every_s` on, none after `until` (monotonic seconds): the soak's
        end, so that its last samples see the rows settle."""
        super().__init__(name="staticrt-replica-killer", daemon=True)
        self.url, self.every_s, self.start_at, self.until = url, every_s, start, until
        self.kills: list[dict[str, Any]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        import httpx

        while not self.stopped.wait(self.every_s) and time.monotonic() < self.until:
            try:
                health = httpx.get(f"{self.url}/health", timeout=30).json()
            except httpx.HTTPError:  # the ingress busy past 30 s: the next period tries again
                continue
            live = [name for name in health["replicas"] if _alive(_pid(name))]
            if not live:
                continue
            victim = max(live, key=lambda name: health["holding"].get(name, 0))
            os.kill(_pid(victim), signal.SIGKILL)
            self.kills.append(
                {"t_s": round(time.monotonic() - self.start_at, 1), "replica": victim,
                 "holding": health["holding"].get(victim, 0), "streaming": health["streaming"].get(victim, 0)}
            )  # fmt: skip

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_summary(kills: list[dict[str, Any]], answered_s: list[float], url: str) -> dict[str, Any]:
    """Per kill, the answers' rate in the minute before it (a `RECOVERY_WINDOW_S` window's worth)
    and the seconds after it until a window's answers reach `RECOVERED` of that (None: never);
    over all, the streams the killed replicas were streaming and the requests the ingress sent
    again (/metrics). `answered_s`: when each answer came whole, in seconds from the soak's start."""
    times = np.asarray(sorted(answered_s))
    for kill in kills:
        at = kill["t_s"]
        before = ((times >= at - 60) & (times < at)).sum() * RECOVERY_WINDOW_S / min(60.0, max(at, 1.0))
        kill["rate_before"] = float(before)
        kill["recovery_s"] = None
        for start in np.arange(at, times[-1] if len(times) else at, 1.0):
            window = ((times >= start) & (times < start + RECOVERY_WINDOW_S)).sum()
            if window >= RECOVERED * before:
                kill["recovery_s"] = float(start + RECOVERY_WINDOW_S - at)
                break
    return {
        "answered_s": [round(float(t), 2) for t in times],  # the timeline the recoveries are read from
        "kills": kills,
        "streaming_at_kills": sum(k["streaming"] for k in kills),
        "lost_streams_ingress": metric(url, "staticrt_replica_lost_streams_total"),
        "retried": metric(url, "staticrt_replica_retries_total"),
        "slowest_recovery_s": max((k["recovery_s"] or float("inf") for k in kills), default=None),
    }
