"""The run directory's lock: one training job at a time per `train.run_dir`.

Two jobs training into one directory would interleave their checkpoints and metrics (after a
`kill -9` of the torchrun launcher, say, its workers go on while a new job starts). Rank 0 holds an
exclusive POSIX record lock (`lockf`) on `<run_dir>/.lock` for the job's lifetime; the operating
system releases it when the process ends, however it ends, so a dead job never leaves it stuck.
Unlike an `flock`, a record lock belongs to the process, not to the open file, so a child forked
while it is held (a DataLoader worker that outlives a killed trainer) does not hold it; the file is
close-on-exec, so an exec'd child has no copy either. A record lock is also released when the
process closes any descriptor of the file, so a second lock of the same directory in one process
is refused before the file is opened. The file records the holder's pid and host for the message
that a second job gets.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from types import TracebackType
from typing import IO

from codatrain.train.distributed import decide_on_rank0

LOCK_FILE = ".lock"

# The lock files this process holds, by (device, inode), with the holder line written in each; a
# forked child holds none.
_held: dict[tuple[int, int], str] = {}
os.register_at_fork(after_in_child=_held.clear)


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
            _held.pop(_identity(self.file.fileno()), None)
            self.file.close()  # closing the file releases the lock
            self.file = None

    def _acquire(self) -> None:
        where = f"train.run_dir={self.run_dir}"
        create_run_dir(self.run_dir)
        path = self.run_dir / LOCK_FILE
        try:
            holder = _held.get(_identity(path)) if path.exists() else None
            if holder is None:
                file = open(path, "a+")  # noqa: SIM115 (held open for the run; close-on-exec)
                holder = _lock_or_holder(file)
        except OSError as error:
            raise RunDirError(f"{where} cannot be written ({error.strerror or error})") from None
        if holder is not None:
            raise RunDirError(
                f"{where} is in use by another training job ({holder}); wait for it to end, stop it, "
                "or use another train.run_dir"
            )
        holder = f"pid {os.getpid()} on {socket.gethostname()}"
        file.seek(0)
        file.truncate()
        file.write(holder + "\n")
        file.flush()
        _held[_identity(file.fileno())] = holder
        self.file = file


def _lock_or_holder(file: IO[str]) -> str | None:
    """Lock `file` and return None, or close it and return who holds the lock."""
    try:
        fcntl.lockf(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise
    file.seek(0)
    holder = file.read().strip() or "another process"
    file.close()
    return holder


def _identity(file: Path | int) -> tuple[int, int]:
    """(device, inode) of a path or an open descriptor: the same file under any name."""
    status = os.stat(file)
    return status.st_dev, status.st_ino
