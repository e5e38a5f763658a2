"""The run directory's lock: one training job at a time per `train.run_dir`.

Two jobs training into one directory would interleave their checkpoints and metrics (after a
`kill -9` of the torchrun launcher, say, its workers go on while a new job starts). Rank 0 holds an
exclusive `flock` on `<run_dir>/.lock` for the job's lifetime; the operating system releases it
when the process ends, however it ends, so a dead job never leaves it stuck. The file records the
holder's pid and host for the message that a second job gets.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from types import TracebackType

from codatrain.train.distributed import decide_on_rank0

LOCK_FILE = ".lock"


class RunDirError(RuntimeError):
    """The run directory cannot be used: not a directory, not writable, or in use by another job."""


def create_run_dir(run_dir: str | os.PathLike) -> None:
    """Create the run directory; RunDirError, in one line, if it is a file or cannot be created."""
    run_dir = Path(run_dir)
    where = f"train.run_dir={run_dir}"
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"{where} is a file, not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunDirError(f"{where} cannot be written ({error.strerror or error})") from None


class RunDirLock:
    """`with RunDirLock(run_dir, is_main):` on every rank; rank 0 creates the directory and holds
    the lock, and its failure is raised on every rank."""

    def __init__(self, run_dir: str | os.PathLike, is_main: bool) -> None:
        self.run_dir, self.is_main = Path(run_dir), is_main
        self.file = None

    def __enter__(self) -> RunDirLock:
        decide_on_rank0(self._acquire if self.is_main else lambda: None, RunDirError)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self.file is not None:
            self.file.close()  # closing the file releases the lock
            self.file = None

    def _acquire(self) -> None:
        where = f"train.run_dir={self.run_dir}"
        create_run_dir(self.run_dir)
        try:
            file = open(self.run_dir / LOCK_FILE, "a+")  # noqa: SIM115 (held open for the run)
        except OSError as error:
            raise RunDirError(f"{where} cannot be written ({error.strerror or error})") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise RunDirError(
                f"{where} is in use by another training job ({holder}); wait for it to end, stop it, "
                "or use another train.run_dir"
            ) from None
        file.seek(0)
        file.truncate()
        file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        self.file = file
