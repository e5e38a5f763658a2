"""Faults around checkpoints and run directories (issue 20): flipped bits, exports into a checkpoint,
only broken checkpoints, file-system errors, a second job on one run dir, file modes, and
validation that does not depend on the number of processes."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_checkpoint import CFG, Run, assert_same, flip_bytes

from codatrain.config import CheckpointConfig
from codatrain.model import Llama
from codatrain.model.hf import CONFIG_NAME, WEIGHTS_NAME, save_hf
from codatrain.train import checkpoint_files
from codatrain.train.checkpoint import CheckpointError, inspect_checkpoint
from codatrain.train.checkpointer import Checkpointer
from codatrain.train.hf_io import export_checkpoint_to_hf, load_hf_weights
from codatrain.train.run_lock import RunDirError, RunDirLock

REPO = Path(__file__).resolve().parent.parent


def saved_run(tmp_path, steps=(1, 2), **ckpt) -> Run:
    run = Run(tmp_path, keep_last=0, **ckpt)
    for step in steps:
        run.step()
        run.ckpt.save(step, tokens_seen=step * 512)
    return run


def shard(step_dir: Path) -> Path:
    return next(step_dir.glob("shard-*.safetensors"))


# ---- D2: checksums ---------------------------------------------------------------------------------
def test_flipped_bits_are_refused_by_export_and_init_from(tmp_path):
    run = saved_run(tmp_path, steps=(1,))
    step_1 = tmp_path / "checkpoints/step_1"
    # A good checkpoint initialises a fresh model with its weights (and no optimizer state).
    fresh = Run(tmp_path / "ft", init_from=str(step_1))
    assert fresh.ckpt.restore() == 0 and not fresh.optimizer.state
    assert_same(fresh.model.state_dict(), run.model.state_dict())

    flip_bytes(shard(step_1))
    with pytest.raises(CheckpointError) as error:
        export_checkpoint_to_hf(step_1, tmp_path / "hf")
    assert str(error.value) == (f"{step_1}: {shard(step_1).name} is corrupted (its blake2b checksum differs "
                                "from the one recorded when it was written)")
    with pytest.raises(CheckpointError, match="step_1: shard-.* is corrupted .*checksum"):
        Run(tmp_path / "ft2", init_from=str(step_1)).ckpt.restore()


@pytest.mark.parametrize("keep_last, kept", [(2, ["step_1", "step_2", "step_5"]), (1, ["step_2", "step_5"])])
def test_a_broken_newest_checkpoint_never_prunes_good_ones(tmp_path, keep_last, kept):
    saved_run(tmp_path, steps=(1, 5))
    flip_bytes(shard(tmp_path / "checkpoints/step_5"))
    resumed = Run(tmp_path, keep_last=keep_last)
    assert resumed.ckpt.restore() == 1
    resumed.step()
    resumed.ckpt.save(2, tokens_seen=2 * 512)
    # Counted: step_2 and step_1 (good); step_5 is broken, left for inspection, and not counted.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == kept


def as_version_1(step_dir: Path) -> None:
    """Rewrite a checkpoint's manifest as version 1 wrote it: each file's size, no checksums."""
    manifest = json.loads((step_dir / "checkpoint.json").read_text())
    manifest["version"] = 1
    manifest["files"] = {name: record["bytes"] for name, record in manifest["files"].items()}
    (step_dir / "checkpoint.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("reached_by", ["resume=auto", "resume=<path>", "init_from", "keep_last"])
def test_version_1_checkpoints_without_checksums_still_resume_with_a_warning(tmp_path, reached_by):
    """However the run reaches a version 1 checkpoint (resuming it, naming it, starting from its
    weights, or counting it for keep_last at two saves), the run's log says once that it cannot be
    verified."""
    saved_run(tmp_path, steps=(1, 2) if reached_by == "keep_last" else (1,))
    step_1 = tmp_path / "checkpoints/step_1"
    as_version_1(step_1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, in the run's log, not also as a Python warning
        if reached_by == "resume=auto":
            run = Run(tmp_path, keep_last=3)
            assert run.ckpt.restore() == 1
        elif reached_by == "resume=<path>":
            run = Run(tmp_path / "other", resume=str(step_1))
            assert run.ckpt.restore() == 1
        elif reached_by == "init_from":
            run = Run(tmp_path / "ft", init_from=str(step_1))
            assert run.ckpt.restore() == 0
        else:
            run = Run(tmp_path, keep_last=3)
            assert run.ckpt.restore() == 2
        for step in (3, 4):
            run.step()
            run.ckpt.save(step, tokens_seen=step * 512)
    assert sum("without checksums" in line and "cannot be verified" in line for line in run.logs) == 1


def _files_ending(manifest, suffix):
    return {name: record for name, record in manifest["files"].items() if name.endswith(suffix)}


def test_version_1_checkpoints_inspected_without_a_log_give_a_python_warning(tmp_path):
    saved_run(tmp_path, steps=(1,))
    step_1 = tmp_path / "checkpoints/step_1"
    as_version_1(step_1)
    with pytest.warns(UserWarning) as record:
        inspect_checkpoint(step_1)
    assert [str(w.message) for w in record] == [
        f"{step_1} was written without checksums (a version 1 checkpoint): it cannot be verified"
    ]


@pytest.mark.parametrize("name", ["shard", "rank_00000.json"])
def test_unparsable_files_are_found_without_checksums(tmp_path, name):
    """inspect_checkpoint(verify=False), which resuming uses after the choice, still parses every
    safetensors header and JSON file."""
    saved_run(tmp_path, steps=(1,))
    step_1 = tmp_path / "checkpoints/step_1"
    path = shard(step_1) if name == "shard" else step_1 / name
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)
    with pytest.raises(CheckpointError, match=rf"step_1: {path.name} is corrupted \((?!its blake2b)"):
        inspect_checkpoint(step_1, verify=False)


MANIFEST_FAULTS = {
    "a list": (lambda m: [m], "checkpoint.json is not a codatrain-checkpoint version 1 or 2 manifest"),
    "another format": (lambda m: m | {"format": "other"},
                       "checkpoint.json is not a codatrain-checkpoint version 1 or 2 manifest"),
    "a future version": (lambda m: m | {"version": 3},
                         "checkpoint.json is not a codatrain-checkpoint version 1 or 2 manifest"),
    "no schedule or files": (lambda m: {k: v for k, v in m.items() if k not in ("scheduler", "files")},
                             "checkpoint.json lacks scheduler, files"),
    "no rank file": (lambda m: m | {"files": _files_ending(m, ".safetensors")},
                     "checkpoint.json does not list every rank's files"),
    "no tensor file": (lambda m: m | {"files": _files_ending(m, ".json")},
                       "checkpoint.json does not list every rank's files"),
}


@pytest.mark.parametrize("fault", MANIFEST_FAULTS)
def test_manifests_that_do_not_describe_a_whole_checkpoint_are_refused(tmp_path, fault):
    saved_run(tmp_path, steps=(1,))
    step_1 = tmp_path / "checkpoints/step_1"
    change, message = MANIFEST_FAULTS[fault]
    manifest = json.loads((step_1 / "checkpoint.json").read_text())
    (step_1 / "checkpoint.json").write_text(json.dumps(change(manifest)))
    with pytest.raises(CheckpointError) as error:
        inspect_checkpoint(step_1)
    assert str(error.value) == f"{step_1}: {message}"


def test_a_missing_checkpoint_folder_is_named(tmp_path):
    with pytest.raises(CheckpointError) as error:
        inspect_checkpoint(tmp_path / "step_9")
    assert str(error.value) == f"{tmp_path / 'step_9'}: no such checkpoint directory"


def test_saving_hashes_while_writing_and_records_every_file(tmp_path):
    saved_run(tmp_path, steps=(1,))
    step_1 = tmp_path / "checkpoints/step_1"
    files = inspect_checkpoint(step_1)["files"]
    assert sorted(files) == sorted(p.name for p in step_1.iterdir() if p.name != "checkpoint.json")
    for name, record in files.items():
        assert record["bytes"] == (step_1 / name).stat().st_size
        assert record["blake2b"] == checkpoint_files.file_checksum(step_1 / name)


# ---- D3: exports into a checkpoint; stray files in one ---------------------------------------------
def test_export_into_a_checkpoint_folder_is_refused(tmp_path):
    saved_run(tmp_path, steps=(1, 2))
    step_1 = tmp_path / "checkpoints/step_1"
    for out in (step_1, step_1 / "hf", tmp_path / "checkpoints/step_2/hf", tmp_path / "checkpoints",
                tmp_path / "checkpoints/hf"):
        with pytest.raises(ValueError, match="inside the checkpoint folder"):
            export_checkpoint_to_hf(step_1, out)
    assert not (step_1 / WEIGHTS_NAME).exists()
    export_checkpoint_to_hf(step_1, tmp_path / "hf")  # beside the checkpoints: fine


def test_resume_reads_only_the_files_the_manifest_lists(tmp_path):
    run = saved_run(tmp_path, steps=(1,))
    expected = run.canonical()
    step_1 = tmp_path / "checkpoints/step_1"
    # What an export into the checkpoint's folder left there before it was refused: bf16 weights
    # whose names (model.layers...) are checkpoint keys too.
    save_hf(step_1, CFG, ((k, v + 1) for k, v in run.model.state_dict().items()), dtype=torch.bfloat16)
    resumed = Run(tmp_path)
    assert resumed.ckpt.restore() == 1
    assert_same(resumed.canonical(), expected)
    export_checkpoint_to_hf(step_1, tmp_path / "hf")
    exported = Llama(CFG)
    load_hf_weights(exported, tmp_path / "hf", CFG, print)
    assert_same(exported.state_dict(), run.model.state_dict())


# ---- D4: only broken checkpoints ---------------------------------------------------------------------
def test_resume_auto_with_only_broken_checkpoints_fails_naming_them(tmp_path):
    saved_run(tmp_path, steps=(1, 2))
    flip_bytes(shard(tmp_path / "checkpoints/step_2"))
    (tmp_path / "checkpoints/step_1/checkpoint.json").unlink()
    with pytest.raises(CheckpointError) as error:
        Run(tmp_path).ckpt.restore()
    message = str(error.value)
    assert "no usable checkpoint" in message and "step_1" in message and "step_2" in message
    assert "checkpoint.resume=<path>" in message and "train.run_dir" in message
    assert "\n" not in message
    broken = []  # newest first, each as inspecting it alone says
    for step in (2, 1):
        with pytest.raises(CheckpointError) as one:
            inspect_checkpoint(tmp_path / f"checkpoints/step_{step}")
        broken.append(str(one.value))
    assert message == (
        f"checkpoint.resume=auto found no usable checkpoint in {tmp_path / 'checkpoints'}: "
        f"{'; '.join(broken)}. Resume one by name with checkpoint.resume=<path>, or start a new run with "
        "another train.run_dir"
    )


# ---- D6: file-system faults ----------------------------------------------------------------------------
def test_disk_full_during_a_save_removes_the_partial_folder_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch):
    run = saved_run(tmp_path, steps=(1,))

    def disk_full(self, data):
        self.raw.write(bytes(memoryview(data)[:100]))  # part of the file reached the disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    run.step()
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_files.HashingStream, "write", disk_full)
        with pytest.raises(CheckpointError) as error:
            run.ckpt.save(2, tokens_seen=2 * 512)
    message = str(error.value)
    assert "step_2 failed (OSError on rank 0: [Errno 28] No space left on device)" in message
    assert message.endswith("removed the partial .tmp-step_2, earlier checkpoints are kept")
    assert "\n" not in message
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1"]
    assert Run(tmp_path).ckpt.restore() == 1
    run.ckpt.save(2, tokens_seen=2 * 512)  # with room again the same run saves
    assert inspect_checkpoint(tmp_path / "checkpoints/step_2")["step"] == 2


def test_a_failed_hf_export_is_one_checkpoint_error_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    run = saved_run(tmp_path, steps=(1,), save_hf_every=1)
    hf = tmp_path / "hf"
    hf.write_text("")  # not a folder: the export cannot be made there
    with pytest.raises(CheckpointError) as error:
        run.ckpt.export_hf(1)
    message = str(error.value)
    assert message.startswith(f"exporting Hugging Face weights to {hf / 'step_1'} failed (NotADirectoryError")
    assert message.endswith("removed the partial .tmp-step_1, the checkpoints are kept")
    assert "\n" not in message
    hf.unlink()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr("codatrain.model.hf.save_file", disk_full)
        with pytest.raises(CheckpointError, match=r"\(OSError: \[Errno 28\] No space left on device\)"):
            run.ckpt.export_hf(1)
    assert list(hf.iterdir()) == []
    assert (run.ckpt.export_hf(1) / WEIGHTS_NAME).is_file()  # with room again the same run exports


def test_a_checkpoints_folder_that_cannot_be_made_is_a_checkpoint_error(tmp_path, monkeypatch):
    run = Run(tmp_path)
    run.step()

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(CheckpointError, match=r"^OSError: \[Errno 30\] Read-only file system$"):
        run.ckpt.save(1, tokens_seen=1 * 512)


def test_saving_a_step_again_where_its_old_copy_cannot_be_removed_is_a_checkpoint_error(
        tmp_path, monkeypatch):
    """On NFS a file still open in the old copy makes its removal fail (EBUSY) after the new copy
    took its place: the save is a CheckpointError naming that, and the new checkpoint is whole."""
    run = saved_run(tmp_path, steps=(1,))
    remove = shutil.rmtree

    def busy_old_copies(path, *args, **kwargs):
        if Path(path).name.startswith(".tmp-old-") and Path(path).exists():
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        remove(path, *args, **kwargs)

    run.step()
    monkeypatch.setattr(shutil, "rmtree", busy_old_copies)
    with pytest.raises(CheckpointError, match=r"saving .*step_1 failed \(\[Errno 16\] "
                                              r"Device or resource busy: '.*\.tmp-old-step_1'\)"):
        run.ckpt.save(1, tokens_seen=1 * 512)
    monkeypatch.undo()
    assert Run(tmp_path).ckpt.restore() == 1
    assert inspect_checkpoint(tmp_path / "checkpoints/step_1")["step"] == 1


def test_unusable_run_dirs_are_one_line_errors(tmp_path, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(RunDirError, match="is a file, not a directory"), RunDirLock(a_file, True):
        pass
    with pytest.raises(RunDirError, match="cannot be written .Not a directory"), \
            RunDirLock(a_file / "run", True):
        pass

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(RunDirError, match="cannot be written .Read-only file system"), \
            RunDirLock(tmp_path / "ro", True):
        pass


def test_scripts_report_file_system_faults_in_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    proc = subprocess.run([sys.executable, str(REPO / "scripts/train.py"), f"train.run_dir={a_file}"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: train.run_dir={a_file} is a file, not a directory"]

    saved_run(tmp_path / "run", steps=(1,))
    proc = subprocess.run([sys.executable, str(REPO / "scripts/export_hf.py"),
                           str(tmp_path / "run/checkpoints/step_1"), str(a_file)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {a_file} is a file; the export needs a directory"]


# ---- D8: one job per run dir ---------------------------------------------------------------------------
def test_a_second_job_on_a_run_dir_is_refused_and_a_dead_jobs_lock_does_not_stick(tmp_path):
    with RunDirLock(tmp_path, True):
        with pytest.raises(RunDirError, match=rf"in use by another training job \(pid {os.getpid()} on "), \
                RunDirLock(tmp_path, True):
            pass
        # The refusal left the lock held (a record lock goes with any descriptor the process closes).
        other = subprocess.run(
            [sys.executable, "-c", "from codatrain.train.run_lock import RunDirLock; "
             f"RunDirLock({str(tmp_path)!r}, True).__enter__()"], capture_output=True, text=True)
        assert f"in use by another training job (pid {os.getpid()} on " in other.stderr
    with RunDirLock(tmp_path, True):  # released at the end of the first
        pass
    # A job killed with SIGKILL while it holds the lock.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from codatrain.train.run_lock import RunDirLock; "
         f"lock = RunDirLock({str(tmp_path)!r}, True).__enter__(); print('locked', flush=True); "
         "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"), RunDirLock(tmp_path, True):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunDirLock(tmp_path, True):
        pass


def test_a_child_forked_by_the_lock_holder_does_not_keep_the_lock_when_the_holder_dies(tmp_path):
    # A DataLoader worker is such a child: it may outlive a trainer killed with SIGKILL.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, time; from codatrain.train.run_lock import RunDirLock; "
         f"lock = RunDirLock({str(tmp_path)!r}, True).__enter__(); child = os.fork(); "
         "time.sleep(600) if child == 0 else print(child, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline())
    try:
        with pytest.raises(RunDirError, match=f"pid {holder.pid}"), RunDirLock(tmp_path, True):
            pass
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # the child lives on
        with RunDirLock(tmp_path, True):
            pass
    finally:
        holder.kill()
        os.kill(child, signal.SIGKILL)


def test_a_job_that_the_lock_refuses_leaves_the_running_jobs_config_record(tmp_path):
    """Hydra wrote <run_dir>/.hydra (the composed config, the overrides) before the job asked for the
    lock: a second job refused by it overwrote the record of the one running. The run writes it once
    it holds the directory."""
    command = [sys.executable, str(REPO / "scripts/train.py"), f"train.run_dir={tmp_path}", "data=synthetic",
               "train.steps=1", "train.val_every=0", "checkpoint.at_end=false", "train.progress=false"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with RunDirLock(tmp_path, True):  # a job running there
        refused = subprocess.run([*command, "optim.lr=0.5"], capture_output=True, text=True, timeout=120,
                                 env=env)
    assert refused.returncode == 1 and "is in use by another training job" in refused.stderr
    assert not (tmp_path / ".hydra").exists()
    ran = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "- train.steps=1\n" in (tmp_path / ".hydra/overrides.yaml").read_text()
    assert "steps: 1\n" in (tmp_path / ".hydra/config.yaml").read_text()
    assert (tmp_path / ".hydra/hydra.yaml").is_file()


# ---- D9: file modes -------------------------------------------------------------------------------------
def test_hf_exports_have_the_mode_of_other_outputs(tmp_path):
    run = saved_run(tmp_path, steps=(1,))
    ckpt = Checkpointer(CheckpointConfig(), tmp_path, CFG, run.model, run.optimizer, run.scheduler, {}, print)
    live = ckpt.export_hf(1)
    export_checkpoint_to_hf(tmp_path / "checkpoints/step_1", tmp_path / "offline", max_shard_bytes=100_000)
    umask = os.umask(0)
    os.umask(umask)
    expected = 0o666 & ~umask
    weights = [*live.glob("*.safetensors"), *(tmp_path / "offline").glob("*.safetensors")]
    assert len(weights) > 2
    for path in [*weights, live / CONFIG_NAME, shard(tmp_path / "checkpoints/step_1")]:
        assert path.stat().st_mode & 0o777 == expected, path
