"""A process lost mid-run, on 2 simulated nodes × 2 processes (loopback): the README's multi-node
command, with c10d rendezvous and --max-restarts, brings the job back from its last checkpoint by
itself. The process is killed while the checkpoint of step 15 is being saved: that save never
becomes a checkpoint unless every rank finished writing it. The final losses are the uninterrupted
run's, the log says which rank died, after which step and from which step the job resumed."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from codatrain.train.attempts import describe_attempt
from codatrain.train.checkpoint import checkpoint_dirs, inspect_checkpoint
from codatrain.train.logger import read_losses

REPO = Path(__file__).resolve().parent.parent
STEPS, KILL_IN_SAVE = 20, 15  # steps after the restart, from step 10 or 15, to compare
COMMON = [
    "train.log_every=1", "train.progress=false", "data=synthetic", "data.num_workers=0",
    "data.seq_len=32", "train.micro_batch_size=2", "model.n_layers=2", "optim.warmup_steps=2",
    f"train.steps={STEPS}", "train.val_every=5", "train.val_batches=3", "checkpoint.every=5",
]


def readme_launcher() -> tuple[dict[str, str], list[str]]:
    """The environment and torchrun options of the README's multi-node command."""
    readme = (REPO / "README.md").read_text()
    command = re.search(r"^(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun .*?)scripts/train\.py(.*?)```",
                        readme, re.M | re.S)
    assert command, "README: the multi-node torchrun command"
    words = shlex.split(command.group(1).replace("\\\n", " "))
    assert "parallel.dp_replicate=auto" in command.group(2)
    env = dict(w.split("=", 1) for w in words[:words.index("torchrun")])
    return env, words[words.index("torchrun") + 1:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run_dir: Path, rdzv_id: str) -> list[subprocess.Popen]:
    """The README command on two simulated nodes of 2 processes; one agent per node."""
    env, options = readme_launcher()
    port = free_port()
    replace = {"--nproc-per-node": "2", "--rdzv-endpoint": f"127.0.0.1:{port}", "--rdzv-id": rdzv_id}
    options = [f"{o.split('=')[0]}={replace[o.split('=')[0]]}" if o.split("=")[0] in replace else o
               for o in options]
    cmd = [sys.executable, "-m", "torch.distributed.run", *options, str(REPO / "scripts" / "train.py"),
           *COMMON, "parallel.dp_replicate=auto", f"train.run_dir={run_dir}"]
    return [subprocess.Popen(cmd, cwd=run_dir.parent, env={**os.environ, **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True) for _ in range(2)]


def finish(agents: list[subprocess.Popen]) -> str:
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(o[-4000:] for o in outputs)
    return "\n".join(outputs)


def worker_of_rank(agents: list[subprocess.Popen], rank: int) -> int:
    """The pid of the worker with global rank `rank` (a child of one of the agents)."""
    agent_pids = {agent.pid for agent in agents}
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid in agent_pids and f"RANK={rank}".encode() in environ:
            return int(proc.name)
    raise AssertionError(f"no worker of rank {rank}")


def test_a_killed_process_restarts_the_job_from_its_last_checkpoint(tmp_path):
    reference = tmp_path / "uninterrupted"
    reference.mkdir()
    output = finish(launch(reference, "uninterrupted"))
    assert "4 × cpu (HSDP 2 replicas × 2 shards)" in (reference / "train.log").read_text(), output

    run_dir = tmp_path / "lost"
    run_dir.mkdir()
    agents = launch(run_dir, "lost")
    saving = run_dir / "checkpoints" / f".tmp-step_{KILL_IN_SAVE}"
    deadline = time.monotonic() + 240
    while not saving.exists():
        assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "no save of step 15"
        time.sleep(0.002)
    os.kill(worker_of_rank(agents, 3), signal.SIGKILL)
    finish(agents)

    log = (run_dir / "train.log").read_text()
    # Rank 3 alone died; a rank its agent stopped while stuck in a collective with it is named apart.
    restart = re.search(r"^restart: attempt 1 \(4 processes\) ended early: rank 3 \(pid \d+ on [^)]+\) died "
                        r"without a trace after step (\d+), by [-\d]+ [:\d]+ UTC \(killed: [^)]*\); "
                        r"the first error: rank [012] at .+?: .*; resuming from step (\d+)$", log, re.M)
    assert restart, log
    # Killed before it wrote its files, rank 3 leaves step 15 unpublished and the job resumes from
    # step 10; killed after (the save is short), step 15 is complete and the job resumes from it.
    assert int(restart.group(1)) == KILL_IN_SAVE and int(restart.group(2)) in (KILL_IN_SAVE - 5, KILL_IN_SAVE)
    resumed_from = int(restart.group(2))
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{resumed_from}'} at step {resumed_from}" in log
    # The steps trained again after the restart, and the rest, are the uninterrupted run's.
    assert read_losses(run_dir) == read_losses(reference)
    assert log.splitlines()[-1].startswith(f"done: step {STEPS}/{STEPS} | ")
    # Every checkpoint left is complete (checksums included); the next save removed the partial one.
    for _, path in checkpoint_dirs(run_dir / "checkpoints"):
        inspect_checkpoint(path)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_the_report_names_the_silent_rank_and_nothing_after_a_finished_attempt(tmp_path):
    def write(folder, rank, world_size=2, host="node-b", **end):
        record = {"rank": rank, "world_size": world_size, "host": host, "pid": 100 + rank, "started": 0.0,
                  **end}
        (folder / f"rank_{rank:05d}.json").write_text(json.dumps(record))

    finished = tmp_path / "1"
    finished.mkdir()
    for rank in (0, 1):
        write(finished, rank, ended=5.0, step=8, error=None)
    assert describe_attempt(finished) is None
    killed = tmp_path / "2"
    killed.mkdir()
    write(killed, 0, ended=60.0, step=9, error="RuntimeError: peer")
    write(killed, 1)
    assert describe_attempt(killed) == (
        "attempt 2 (2 processes) ended early: rank 1 (pid 101 on node-b) died without a trace after "
        "step 9, by 1970-01-01 00:01:00 UTC (killed: SIGKILL, the OOM killer or a lost node); the first "
        "error: rank 0 at 1970-01-01 00:01:00 UTC: RuntimeError: peer")
    # Ranks stuck in a collective with the dead one when their agent stopped them: named apart, by
    # where they were; with no error recorded, their signal dates the death.
    stuck = tmp_path / "3"
    stuck.mkdir()
    write(stuck, 0, world_size=3)
    for rank in (1, 2):
        write(stuck, rank, world_size=3, host="node-a",
              signalled={"signal": "SIGTERM", "at": 50.0 + rank, "step": 9, "where": "wait (c10d.py:7)"})
    assert describe_attempt(stuck) == (
        "attempt 3 (3 processes) ended early: rank 0 (pid 100 on node-b) died without a trace after "
        "step 9, by 1970-01-01 00:00:51 UTC (killed: SIGKILL, the OOM killer or a lost node); rank 1 (pid "
        "101 on node-a), rank 2 (pid 102 on node-a) did not end after SIGTERM (killed after it), stuck in "
        "wait (c10d.py:7)")


def test_a_rank_stuck_when_the_agent_stops_it_is_reported_stuck_not_dead(tmp_path):
    """A rank blocked in a collective whose peer died gets torchrun's SIGTERM and, 30 s later, its
    SIGKILL: no Python handler runs in between. Its record still says it was signalled, where it was
    stuck and after which step, so the report does not count it among the dead."""
    child = subprocess.Popen([sys.executable, "-c", STUCK_RANK, str(tmp_path)], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline() == "blocked\n"
    record = tmp_path / "attempts" / "1" / "rank_00000.json"
    os.kill(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while "signalled" not in record.read_text():
        assert time.monotonic() < deadline and child.poll() is None, record.read_text()
        time.sleep(0.01)
    assert child.poll() is None  # still blocked, as under torchrun until the SIGKILL
    child.kill()
    child.wait()
    report = describe_attempt(tmp_path / "attempts" / "1")
    assert re.fullmatch(rf"attempt 1 \(1 process\) ended early: rank 0 \(pid {child.pid} on .+\) did not "
                        r"end after SIGTERM \(killed after it\), stuck in "
                        r"wait_for_the_dead_peer \(<string>:\d+\)", report), report
    assert json.loads(record.read_text())["signalled"]["step"] == 7


def test_a_rank_that_ends_after_a_signal_reports_its_end_and_not_its_forked_workers_signals(tmp_path):
    child = subprocess.run([sys.executable, "-c", SIGNALLED_THEN_ENDED, str(tmp_path)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    record = json.loads((tmp_path / "attempts" / "1" / "rank_00000.json").read_text())
    assert "signalled" not in record and record["step"] == 8 and record["error"] is None
    assert describe_attempt(tmp_path / "attempts" / "1") is None


# A rank under StopSignals (what fit() runs under) blocked in a call that never returns.
STUCK_RANK = """
import os, sys, torch
from codatrain.train.attempts import Attempt
from codatrain.train.distributed import DistInfo
from codatrain.train.stopping import StopSignals

def wait_for_the_dead_peer():
    never_written, _ = os.pipe()
    print("blocked", flush=True)
    os.read(never_written, 1)

attempt = Attempt(sys.argv[1], DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
with attempt.record_signals(lambda: 7), StopSignals(torch.device("cpu")):
    wait_for_the_dead_peer()
"""

SIGNALLED_THEN_ENDED = """
import os, signal, sys, time, json, torch
from pathlib import Path
from codatrain.train.attempts import Attempt
from codatrain.train.distributed import DistInfo
from codatrain.train.stopping import StopSignals

attempt = Attempt(sys.argv[1], DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
with attempt.record_signals(lambda: 8), StopSignals(torch.device("cpu")) as stop:
    worker = os.fork()  # as a DataLoader worker is: it inherits the handlers
    if worker == 0:
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(0)
    os.waitpid(worker, 0)
    time.sleep(0.5)  # the watcher reads a byte in microseconds
    assert "signalled" not in attempt.file.read_text(), "the worker's signal recorded as this rank's"
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 60
    while "signalled" not in attempt.file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert stop.agreed() == "SIGTERM"
attempt.end(8, None)
"""
