"""scripts/bench_scaling.py on CPU (gloo): 1 process vs 2 simulated nodes × 1 process on loopback
(--mesh auto: one replica per node), the 2-process checkpoint resumed on 1; the torchrun command of
every leg on one node and on several."""

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from codatrain.train.runs import TRAIN_SCRIPT, Launch, train_command

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "bench_scaling.py"
TRAIN = ["data=synthetic", "data.num_workers=0", "data.seq_len=64", "train.micro_batch_size=4",
         "optim.warmup_steps=2"]


def bench_command(out: Path, *options: str, overrides: list[str] = TRAIN) -> list[str]:
    return [sys.executable, str(SCRIPT), "--variants", "eager", "--steps", "8", "--throughput-steps", "3",
            "--warmup", "1", "--window", "2", "--out", str(out), *options, "--", *overrides]


def bench(out: Path, *options: str, overrides: list[str] = TRAIN) -> subprocess.CompletedProcess:
    return subprocess.run(bench_command(out, "--nproc", "2", *options, overrides=overrides), cwd=out.parent,
                          capture_output=True, text=True, timeout=600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_legs_checks_and_rerun(tmp_path):
    """One call per simulated node, as on a cluster: node 1 joins the 2-process legs only."""
    out = tmp_path / "scaling"
    nodes = ["--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "t"]
    # No timing threshold in a test: the efficiency check is switched off here.
    calls = [subprocess.Popen(bench_command(out, *nodes, "--node-rank", str(rank), "--mesh", "auto",
                                            "--min-efficiency", "0", "--plot", str(tmp_path / "loss.png")),
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [call.communicate(timeout=600)[0] for call in calls]
    assert [call.returncode for call in calls] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    launched = [[line for line in o.splitlines() if line.startswith("+ ")] for o in outputs]
    assert [line.split("train.run_dir=")[1] for line in launched[1]] == [
        str(out / "eager" / leg) for leg in ("throughput_2", "loss_2")]
    assert len(launched[0]) == 5 and all("--standalone" in line for line in launched[0][2:])
    assert "node 1: its part of the 2-process legs is done; node 0 reports" in outputs[1]

    report = json.loads((out / "bench_scaling.json").read_text())
    assert [report[k] for k in ("nnodes", "nproc_per_node", "processes", "mesh")] == [2, 1, 2, "auto"]
    assert report["mesh_degrees"] == {"replicate": 2, "shard": 1}
    assert report["measured"] == ("2 node(s) × 1 process(es) = 2 (replicate 2, --mesh auto) "
                                  "vs 1 process on node 0")
    for leg in ("throughput_2", "loss_2"):
        assert "2 × cpu (replicate 2)" in (out / "eager" / leg / "train.log").read_text()
    (eager,) = report["variants"]
    assert set(eager["throughput"]["tokens_per_s_per_device"]) == {"1", "2"}
    assert sorted(map(int, eager["losses"]["loss_1"])) == list(range(1, 9))
    assert sorted(map(int, eager["losses"]["resume_1"])) == list(range(5, 9))
    # fp32 on CPU: 1 process accumulating 2 micro-batches and 2 replicas differ only in the order of
    # gradient sums; the resumed run starts from the 2-node step-4 checkpoint resharded.
    for check in ("parity", "resume"):
        assert eager[check]["ok"]
        assert eager[check]["first_step_rel_diff"] < 1e-5
        assert eager[check]["max_step_abs_diff"] < 1e-4
    assert eager["resume"]["first_step"] == 5
    assert (out / "eager" / "loss_2" / "checkpoints" / "step_4").is_dir()
    assert (tmp_path / "loss.png").stat().st_size > 10_000

    # A second call finds every leg complete and only re-evaluates (node 0 alone: no leg runs, so
    # no node has to join): here a check that fails.
    proc = subprocess.run(bench_command(out, *nodes, "--mesh", "auto", "--min-efficiency", "1000"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert proc.stdout.count("complete, not run again") == 5
    assert "throughput FAILED" in proc.stdout.splitlines()[-1]


def test_torchrun_command_of_each_leg_on_one_node_and_on_two(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_scaling

    args = argparse.Namespace(out=tmp_path, mesh="auto", overrides=["data=synthetic"], steps=8,
                              throughput_steps=3)
    python = [sys.executable, "-m", "torch.distributed.run"]
    standalone = lambda nproc: ["--standalone", f"--nproc-per-node={nproc}"]
    two_nodes = ["--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=head:29500"]
    for nodes, expected in [
        (Launch(8), {"throughput_8": standalone(8), "loss_8": standalone(8)}),
        # The same command on every node; each leg meets at a rendezvous of its own.
        (Launch(4, 2, "head:29500", "job7"), {"throughput_8": [*two_nodes, "--rdzv-id=job7-eager-throughput"],
                                              "loss_8": [*two_nodes, "--rdzv-id=job7-eager-loss"]}),
    ]:
        legs = bench_scaling.variant_legs("eager", args, nodes, micro_batch=2, seq_len=16)
        assert list(legs) == ["throughput_8", "loss_8", "throughput_1", "loss_1", "resume_1"]
        expected |= {leg: standalone(1) for leg in ("throughput_1", "loss_1", "resume_1")}
        for name, leg in legs.items():
            assert train_command(leg.launch, ["x=1"], tmp_path / name) == [
                *python, *expected[name], str(TRAIN_SCRIPT), "x=1", "train.log_every=1", "train.val_every=0",
                "train.progress=false", f"train.run_dir={tmp_path / name}"]
    with pytest.raises(ValueError, match="a launch on 2 nodes needs a rendezvous endpoint and id"):
        Launch(4, 2)


def test_a_mesh_that_does_not_fit_is_refused_before_any_job(tmp_path):
    proc = bench(tmp_path / "scaling", "--mesh", "3x1")
    assert proc.returncode == 2
    assert ("--mesh 3x1 on 1 node(s) × 2 processes: parallel.dp_replicate × parallel.dp_shard = 3 × 1 = 3, "
            "but the job has 2 processes") in proc.stderr
    assert not (tmp_path / "scaling").exists()


def test_bad_override_is_named_before_any_job(tmp_path):
    proc = bench(tmp_path / "scaling", overrides=["train.bogus_key=1"])
    assert proc.returncode == 2
    assert "bogus_key" in proc.stderr
    assert not (tmp_path / "scaling").exists()


@pytest.mark.parametrize("options, refusal", [
    # --window 0 ran every leg, then stopped in a traceback (range() with a step of 0).
    (["--window", "0"], "--window must be at least 1, got 0"),
    # --warmup -1 with --throughput-steps 0 ran the legs, whose train.steps=0 each refused.
    (["--throughput-steps", "0", "--warmup", "-1"], "--warmup must be 0 or more and smaller than "
                                                      "--throughput-steps"),
])
def test_options_no_check_can_use_are_refused_before_any_job(tmp_path, options, refusal):
    proc = bench(tmp_path / "scaling", *options)
    assert proc.returncode == 2 and f"error: {refusal}" in proc.stderr
    assert not (tmp_path / "scaling").exists()


def test_a_misspelt_override_is_named_with_the_nearest_key(tmp_path):
    # It was Hydra's "Could not override ... To append to your config use +train.stesp=3".
    proc = bench(tmp_path / "scaling", overrides=["train.stesp=3"])
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].endswith("error: overrides: unknown config key 'train.stesp'; did "
                                                 "you mean train.steps? (docs/config.md lists every key)")


def test_several_nodes_need_a_rendezvous(tmp_path):
    proc = bench(tmp_path / "scaling", "--nnodes", "2")
    assert proc.returncode == 2
    assert "--rdzv-endpoint and --rdzv-id: give both with --nnodes > 1, neither on one node" in proc.stderr
    assert not (tmp_path / "scaling").exists()
