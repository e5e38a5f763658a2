"""How the previous start of a job ended: the report a restarted job logs first.

Each start of a job in a run directory (an attempt: a launch, or a restart by torchrun's elastic
agents after a process died) has a folder `<run_dir>/attempts/<n>/`, numbered by rank 0. Every rank
writes `rank_<r>.json` there when it starts (host, pid, time) and again when it ends through Python:
the last step it completed and the error that stopped it (a collective whose peer died, the agent's SIGTERM)
or none. A rank killed by SIGKILL, the OOM killer or a lost node writes no end: the next attempt's
rank 0 names it as the rank that died, with the last step the others completed and the time they
stopped.
The run directory must be shared by the nodes (as its checkpoints are).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from codatrain.train.distributed import DistInfo, decide_on_rank0

ATTEMPTS_DIR = "attempts"


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank:05d}.json"


def describe_attempt(folder: Path) -> str | None:
    """One line on how the attempt in `folder` ended, or None when every rank finished."""
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("rank_*.json"))]
    if not records or all(r.get("ended") and r.get("error") is None for r in records):
        return None
    silent = [r for r in records if "ended" not in r]
    stopped = sorted((r for r in records if r.get("error") is not None), key=lambda r: r["ended"])
    parts = []
    if silent:
        died = ", ".join(f"rank {r['rank']} (pid {r['pid']} on {r['host']})" for r in silent)
        when = ""
        if stopped:  # the others stopped at their next collective with it: soon after
            when = f" after step {max(r['step'] for r in stopped)}, by {_clock(stopped[0]['ended'])}"
        parts.append(f"{died} died without a trace{when} (killed: SIGKILL, the OOM killer or a lost node)")
    if stopped:
        first = stopped[0]
        parts.append(f"the first error: rank {first['rank']} at {_clock(first['ended'])}: {first['error']}")
    processes = records[0]["world_size"]
    return f"attempt {folder.name} ({processes} process{'es' if processes > 1 else ''}) ended early: " + (
        "; ".join(parts))


class Attempt:
    """This start of the job: `Attempt(run_dir, dist_info)` on every rank (a collective), then
    `end(step, error)` on every rank. `previous` is the report on the last attempt (rank 0 only;
    None when there was none or it finished)."""

    def __init__(self, run_dir: str | os.PathLike, dist_info: DistInfo) -> None:
        self.root, self.dist = Path(run_dir) / ATTEMPTS_DIR, dist_info
        number, self.previous = decide_on_rank0(self._number, OSError)
        self.file = _rank_file(self.root / str(number), dist_info.rank)
        self.record: dict[str, Any] = {"rank": dist_info.rank, "world_size": dist_info.world_size,
                                       "host": socket.gethostname(), "pid": os.getpid(),
                                       "started": time.time()}
        self._write()

    def _number(self) -> tuple[int, str | None]:
        self.root.mkdir(parents=True, exist_ok=True)
        numbers = sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit())
        number = numbers[-1] + 1 if numbers else 1
        (self.root / str(number)).mkdir()
        return number, describe_attempt(self.root / str(numbers[-1])) if numbers else None

    def _write(self) -> None:
        self.file.write_text(json.dumps(self.record))

    def end(self, step: int, error: BaseException | None) -> None:
        """Record how this rank ends: after step `step`, stopped by `error` or finished (None)."""
        message = None
        if error is not None:  # its first line: gloo's messages go on for several
            message = (f"{type(error).__name__}: {error}".splitlines() or [""])[0][:160]
        self.record.update(ended=time.time(), step=step, error=message)
        self._write()


class Terminated(SystemExit):
    """SIGTERM, as torchrun's agent sends it to the workers it stops."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` (exit status 143) in the main thread, so the
    rank records its end instead of vanishing like a killed one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
