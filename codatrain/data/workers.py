"""DataLoader workers that die with the process that started them and leave stopping to it.

Ctrl-C and SIGTERM reach every process of the job, and a worker they killed would fail the main
process wherever it is: workers ignore both, and the main process stops at a step boundary and
ends its workers itself (codatrain.train.stopping).

A worker blocked on a full pipe to its dead parent never exits (its queue's feeder thread waits
to flush at exit), and an orphaned worker holds what it inherited. On Linux every worker asks the
kernel for SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`), which holds however the
parent ends, SIGKILL included; a worker holds no state worth a graceful stop. Elsewhere the
DataLoader's own check of the parent is all there is.

The same SIGTERM is how multiprocessing ends daemonic children when their parent exits, before it
joins them. Workers are normally shut down by their DataLoader iterator first, but an exception
that ends the process keeps that iterator alive (a worker's re-raised error holds it in a reference
cycle; an uncaught one stays in `sys.last_exc`), and the parent would wait at exit forever: an exit
hook of the parent's, run before multiprocessing's, kills the daemonic children still alive.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int, worker_id: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG) failed in DataLoader worker {worker_id}: "
                             f"{os.strerror(error)}")
    if os.getppid() != parent:  # the parent died before the request
        os.kill(os.getpid(), signal.SIGKILL)


def _init_worker(parent: int | None, worker_id: int) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if parent is not None:
        _die_with_parent(parent, worker_id)


def raised_in_worker(error: BaseException) -> str:
    """The message of an exception a DataLoader worker raised, as the DataLoader re-raises it in
    this process ("Caught <type> in DataLoader worker process <n>.\nOriginal Traceback ... <module>.
    <type>: <message>"), followed by where it was raised; `str(error)` when it is not one."""
    first, _, traceback_text = str(error).partition("\n")
    caught = f"Caught {type(error).__name__} "
    module = type(error).__module__
    # A traceback names a built-in exception without its module: "ValueError: ...".
    last_line = f"{'' if module == 'builtins' else module + '.'}{type(error).__qualname__}: "
    if not first.startswith(caught) or last_line not in traceback_text:
        return str(error)
    return f"{traceback_text.rsplit(last_line, 1)[1].strip()} ({first.removeprefix(caught).rstrip('.')})"


def _kill_workers_left() -> None:
    for child in multiprocessing.active_children():
        if child.daemon:  # DataLoader workers; multiprocessing would SIGTERM them, which they ignore
            child.kill()
            child.join()


@functools.cache
def _kill_workers_left_at_exit() -> None:
    # atexit runs its hooks last-registered first: this one before multiprocessing's, registered
    # when it was imported.
    atexit.register(_kill_workers_left)


def worker_init_fn() -> Callable[[int], None]:
    """The DataLoader `worker_init_fn` of codatrain's loaders: stop signals ignored, and the
    workers' lives tied to this process (Linux), which kills those still alive when it exits."""
    _kill_workers_left_at_exit()
    return functools.partial(_init_worker, os.getpid() if sys.platform == "linux" else None)
