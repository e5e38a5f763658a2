"""How the previous start of a job ended: the report a restarted job logs first.

Each start of a job in a run directory (an attempt: a launch, or a restart by torchrun's elastic
agents after a process died) has a folder `<run_dir>/attempts/<n>/`, numbered by rank 0. Every rank
writes `rank_<r>.json` there when it starts (host, pid, time) and again when it ends through Python:
the last step it completed and the error that stopped it (a collective whose peer died, the agent's SIGTERM)
or none. A rank killed by SIGKILL, the OOM killer or a lost node writes no end: the next attempt's
rank 0 names it as the rank that died, with the last step the others completed and the time they
stopped.

A rank blocked in a collective whose peer died cannot run a Python signal handler until the call
returns, which may be never: torchrun's agent SIGTERMs it, waits 30 s and SIGKILLs it. So that it is
not reported as dead too, a thread records each SIGTERM or SIGINT as it arrives (through Python's
signal wakeup fd, written by the C handler), with where the main thread was; an end recorded after
it replaces it. The report names such ranks apart: they were stopped, stuck where they were.
The run directory must be shared by the nodes (as its checkpoints are).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from codatrain.train.distributed import DistInfo, decide_on_rank0

ATTEMPTS_DIR = "attempts"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
RECORDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # what torchrun's agent sends to stop its workers


def _clock(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank:05d}.json"


def _names(records: list[dict[str, Any]]) -> str:
    return ", ".join(f"rank {r['rank']} (pid {r['pid']} on {r['host']})" for r in records)


def describe_attempt(folder: Path) -> str | None:
    """One line on how the attempt in `folder` ended, or None when every rank finished."""
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("rank_*.json"))]
    if not records or all(r.get("ended") and r.get("error") is None for r in records):
        return None
    silent = [r for r in records if "ended" not in r and "signalled" not in r]
    stuck = [r for r in records if "ended" not in r and "signalled" in r]
    stopped = sorted((r for r in records if r.get("error") is not None), key=lambda r: r["ended"])
    parts = []
    if silent:
        # The others stopped at their next collective with it (an error, or the agent's signal): soon after.
        ends = [(r["step"], r["ended"]) for r in stopped] + [
            (r["signalled"]["step"], r["signalled"]["at"]) for r in stuck]
        when = f" after step {max(s for s, _ in ends)}, by {_clock(min(t for _, t in ends))}" if ends else ""
        parts.append(f"{_names(silent)} died without a trace{when} "
                     "(killed: SIGKILL, the OOM killer or a lost node)")
    if stopped:
        first = stopped[0]
        parts.append(f"the first error: rank {first['rank']} at {_clock(first['ended'])}: {first['error']}")
    for where in sorted({r["signalled"]["where"] for r in stuck}):
        ranks = [r for r in stuck if r["signalled"]["where"] == where]
        signals = "/".join(sorted({r["signalled"]["signal"] for r in ranks}))
        parts.append(f"{_names(ranks)} did not end after {signals} (killed after it), stuck in {where}")
    processes = records[0]["world_size"]
    return f"attempt {folder.name} ({processes} process{'es' if processes > 1 else ''}) ended early: " + (
        "; ".join(parts))


def stopped_by_signal(folder: Path) -> tuple[str, int] | None:
    """(signal, step) when every rank of the attempt in `folder` ended after a stop by Ctrl-C or
    SIGTERM (stopping.py), else None."""
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("rank_*.json"))]
    if not records or any(r.get("error") is not None or "stopped_by" not in r for r in records):
        return None
    return records[0]["stopped_by"], min(r["step"] for r in records)  # all ranks stop after one step


def restarted_by_agent() -> bool:
    """This process is a restart by torchrun's elastic agent (--max-restarts), not a launch."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


def _where(frame: Any) -> str:
    """`function (dir/file.py:line)` of the innermost frame, and of the innermost frame of ours
    under it when that is another one."""
    def place(f: Any) -> str:
        return f"{f.f_code.co_name} ({'/'.join(Path(f.f_code.co_filename).parts[-2:])}:{f.f_lineno})"

    if frame is None:
        return "(no Python frame)"
    ours = frame
    while ours is not None and not Path(ours.f_code.co_filename).resolve().is_relative_to(PACKAGE_DIR):
        ours = ours.f_back
    return place(frame) if ours is None or ours is frame else f"{place(frame)}, from {place(ours)}"


_signal_pipes: set[int] = set()  # the write ends of the record_signals blocks running now


def _no_wakeup_fd_in_a_forked_child() -> None:
    """A forked child (a DataLoader worker) inherits the wakeup fd: the signals it gets would be
    recorded as this rank's."""
    with contextlib.suppress(ValueError):  # forked from a thread other than the main one
        previous = signal.set_wakeup_fd(-1)
        if previous not in _signal_pipes:
            signal.set_wakeup_fd(previous)


os.register_at_fork(after_in_child=_no_wakeup_fd_in_a_forked_child)


def _outside_handler(frame: Any, signum: int) -> Any:
    """The frame the main thread was in when the signal came: where its Python handler (which may be
    running now, when the main thread was not blocked in C) was called from."""
    handler = signal.getsignal(signum)
    code = getattr(getattr(handler, "__func__", handler), "__code__", None)
    inner = frame
    while inner is not None and inner.f_code is not code:
        inner = inner.f_back
    return frame if inner is None else inner.f_back


class Attempt:
    """This start of the job: `Attempt(run_dir, dist_info)` on every rank (a collective), then
    `end(step, error)` on every rank, with `record_signals(...)` around what runs between.
    `previous` is the report on the last attempt (None when there was none or it finished);
    `previous_stop` its (signal, step) when a stop signal ended it (every rank)."""

    def __init__(self, run_dir: str | os.PathLike, dist_info: DistInfo) -> None:
        self.root, self.dist = Path(run_dir) / ATTEMPTS_DIR, dist_info
        number, self.previous, self.previous_stop = decide_on_rank0(self._number, OSError)
        self.number = number
        self.file = _rank_file(self.root / str(number), dist_info.rank)
        self.record: dict[str, Any] = {"rank": dist_info.rank, "world_size": dist_info.world_size,
                                       "host": socket.gethostname(), "pid": os.getpid(),
                                       "started": time.time()}
        self._lock = threading.Lock()  # the signal thread writes the record too
        self._write()

    def _number(self) -> tuple[int, str | None, tuple[str, int] | None]:
        self.root.mkdir(parents=True, exist_ok=True)
        numbers = sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit())
        number = numbers[-1] + 1 if numbers else 1
        (self.root / str(number)).mkdir()
        if not numbers:
            return number, None, None
        last = self.root / str(numbers[-1])
        return number, describe_attempt(last), stopped_by_signal(last)

    def _write(self) -> None:
        # Whole or not at all: a SIGKILL may come in the middle, and the next attempt reads it.
        partial = self.file.with_name(f".{self.file.name}.tmp")
        partial.write_text(json.dumps(self.record))
        os.replace(partial, self.file)

    def end(self, step: int, error: BaseException | None, stopped_by: str | None = None) -> None:
        """Record how this rank ends: after step `step`, stopped by `error` or finished (None), or
        stopped by the signal `stopped_by` (stopping.py)."""
        message = None
        if error is not None:  # its first line: gloo's messages go on for several
            message = (f"{type(error).__name__}: {error}".splitlines() or [""])[0][:160]
        with self._lock:
            self.record.pop("signalled", None)
            self.record.update(ended=time.time(), step=step, error=message)
            if stopped_by is not None:
                self.record["stopped_by"] = stopped_by
            self._write()

    @contextlib.contextmanager
    def record_signals(self, last_step: Callable[[], int]) -> Iterator[None]:
        """Within the block, each SIGTERM or SIGINT is recorded at once by a thread, with the last
        completed step (`last_step()`) and where the main thread was, whatever the main thread is
        blocked in. Main thread only (elsewhere the block records nothing)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C signal handler must never block on it
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        _signal_pipes.add(write_fd)
        watcher = threading.Thread(target=self._watch, args=(read_fd, last_step), daemon=True,
                                   name="codatrain-signal-record")
        watcher.start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous_fd)
            _signal_pipes.discard(write_fd)
            os.write(write_fd, b"\0")  # not a signal number: the watcher returns
            watcher.join()
            os.close(read_fd)
            os.close(write_fd)

    def _watch(self, read_fd: int, last_step: Callable[[], int]) -> None:
        main = threading.main_thread().ident
        while True:
            signums = os.read(read_fd, 64)
            for signum in signums:
                if signum == 0:
                    return
                if signum in RECORDED_SIGNALS:
                    where = _where(_outside_handler(sys._current_frames().get(main), signum))
                    with self._lock:
                        if "ended" not in self.record:
                            self.record["signalled"] = {"signal": signal.Signals(signum).name,
                                                        "at": time.time(), "step": last_step(),
                                                        "where": where}
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
