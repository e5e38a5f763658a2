import json

import pytest
import torch

from codatrain.config import OptimConfig, load_config, validate
from codatrain.train.logger import METRICS_FILE, RunLogger, read_losses, read_records, windowed
from codatrain.train.metrics import DENSE_BF16_PEAK_FLOPS, format_mfu, peak_flops, throughput
from codatrain.train.optim import build_optimizer, lr_factor, update_unless


def test_throughput_and_mfu_by_hand():
    # 8 GPUs train 1,048,576 tokens in 2 s at 1e10 FLOP/token on a 989 TFLOP/s part.
    rate = throughput(tokens=1_048_576, seconds=2.0, world_size=8, flops_per_token=1e10, peak=989e12)
    assert rate.tokens_per_s == 524_288
    assert rate.tokens_per_s_per_device == 65_536
    assert rate.tflops_per_device == pytest.approx(655.36)
    assert rate.mfu == pytest.approx(655.36e12 / 989e12)
    assert format_mfu(rate.mfu) == "66.3%"


def test_mfu_is_na_without_a_known_peak():
    rate = throughput(tokens=1000, seconds=1.0, world_size=1, flops_per_token=1e9, peak=None)
    assert rate.mfu is None and format_mfu(rate.mfu) == "n/a"
    assert peak_flops(torch.device("cpu")) is None


def test_peak_table_prefers_specific_names():
    table = dict(DENSE_BF16_PEAK_FLOPS)
    assert table["H200"] == table["H100"] == 989e12 and table["A100"] == 312e12
    names = [name for name, _ in DENSE_BF16_PEAK_FLOPS]
    assert names.index("H100 PCIe") < names.index("H100")
    assert names.index("GH200") < names.index("H200")


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA H800", 989e12),
    ("NVIDIA H800 PCIe", 756e12), ("NVIDIA H20", 148e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_of_each_device_name(monkeypatch, name, peak):
    """The names torch reports: a PCIe card is not given its SXM sibling's peak."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0)) == peak


def test_schedules():
    cos = OptimConfig(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, 100, cos) == pytest.approx(0.1)
    assert lr_factor(9, 100, cos) == pytest.approx(1.0)
    assert lr_factor(55, 100, cos) == pytest.approx(0.55)  # half-way through the cosine: midpoint
    assert lr_factor(100, 100, cos) == pytest.approx(0.1)
    wsd = OptimConfig(schedule="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0)
    assert lr_factor(50, 100, wsd) == 1.0 and lr_factor(79, 100, wsd) == 1.0
    assert lr_factor(90, 100, wsd) == pytest.approx(0.5)
    assert lr_factor(99, 100, wsd) == pytest.approx(0.05)


def test_wsd_decays_from_the_peak_when_the_warmup_runs_into_its_decay():
    # llama3_125m's recipe (715 warmup steps) with optim=wsd and train.steps=800: the decay was to
    # start at step 640, so after the warmup's peak at 714 step 715 fell to 0.58 of it at once.
    wsd = OptimConfig(schedule="wsd", warmup_steps=715, decay_fraction=0.2, min_lr_ratio=0.1)
    factors = [lr_factor(step, 800, wsd) for step in range(800)]
    assert factors[714] == factors[715] == 1.0
    after = factors[714:]
    assert all(later <= earlier for earlier, later in zip(after, after[1:], strict=False))
    assert all(earlier - later == pytest.approx(0.9 / 85) for earlier, later in zip(after[1:], after[2:],
                                                                                    strict=False))


def test_an_update_flagged_nonfinite_changes_nothing_and_a_divisor_scales_the_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    twin.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW([{"params": [twin[0].weight], "weight_decay": 0.1},
                               {"params": [twin[0].bias, *twin[1].parameters()], "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95), fused=True)

    def backward(m, seed):
        m(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))).square().sum().backward()

    # A step, a skipped one, two steps with their gradients divided (by powers of two: exact).
    for seed, (flag, divisor) in enumerate([(0.0, None), (1.0, 2.0), (0.0, 4.0), (0.0, 0.5)]):
        backward(model, seed)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        state_before = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()}
                        for p in model.parameters()}
        update_unless(optimizer, torch.tensor(flag), None if divisor is None else torch.tensor(divisor))
        assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
        if flag:
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            for p in model.parameters():
                assert all(torch.equal(state_before[id(p)][k], v) for k, v in optimizer.state[p].items())
        else:  # torch's own step on the divided gradients, bit for bit
            backward(twin, seed)
            for p in twin.parameters():
                p.grad /= divisor or 1.0
            plain.step()
            plain.zero_grad()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))
        optimizer.zero_grad()
    assert all(optimizer.state[p]["step"].item() == 3 for p in model.parameters())


def test_metrics_file_reader_and_windows(tmp_path):
    records = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0, "val_loss": 3.5},
               {"step": 3, "val_loss": 3.1}, {"step": 2, "loss": 2.0}]  # a later record of a step wins
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_records(tmp_path) == records
    assert read_losses(tmp_path) == {1: 4.0, 2: 2.0}
    assert windowed({1: 4.0, 2: 2.0, 3: 1.0, 4: 0.0, 5: 9.0}, 2) == {2: 3.0, 4: 0.5}  # step 5: no full window


def test_a_resumed_run_drops_the_records_past_its_checkpoint(tmp_path):
    """Steps 4-5 of an attempt that died before its next checkpoint are trained again after a
    resume at step 3: each step stays in metrics.jsonl once."""
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n"
                                                 for s in range(1, 6)))
    run = validate(load_config([f"train.run_dir={tmp_path}"]))
    logger = RunLogger(run, enabled=True)
    logger.start(3)
    logger.log({"step": 4, "val_loss": 1.0})
    logger.close()
    assert [r["step"] for r in read_records(tmp_path)] == [1, 2, 3, 4]
    assert read_records(tmp_path)[-1] == {"step": 4, "val_loss": 1.0}
    assert (tmp_path / "train.log").read_text() == "step 4/300 | val loss 1.0000\n"


def test_a_last_metrics_line_cut_short_does_not_stop_the_resume(tmp_path):
    """A full disk or a kill in the middle of a record's write leaves part of a line: the resumed run
    drops it with the records past its checkpoint (it was 'error: Expecting ',' delimiter: line 1
    column 25', naming no file, at every resume). A broken line before the last names the file."""
    whole = "".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in range(1, 4))
    (tmp_path / METRICS_FILE).write_text(whole + '{"step": 4, "loss": 2.8')
    assert [r["step"] for r in read_records(tmp_path)] == [1, 2, 3]
    run = validate(load_config([f"train.run_dir={tmp_path}"]))
    logger = RunLogger(run, enabled=True)
    logger.start(3)
    logger.log({"step": 4, "val_loss": 1.0})
    logger.close()
    assert read_records(tmp_path)[-1] == {"step": 4, "val_loss": 1.0}
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "lo\n' + whole)
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}, line 1: not a metrics record"):
        read_records(tmp_path)


def test_allocator_retries_are_warned_at_first_and_when_doubled(monkeypatch):
    """A run at the card's capacity retries every step: one warning line at the first retries (the
    count, the step, the reserved peak against the card's memory), then only when the count has
    doubled since the last; none for a CPU run (None)."""
    from types import SimpleNamespace

    from codatrain.train.trainer import Trainer

    lines = []
    card = SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card)
    trainer = SimpleNamespace(reported_retries=0, step=0, logger=SimpleNamespace(info=lines.append),
                              dist=SimpleNamespace(device=torch.device("cuda", 0)))
    for step, retries in enumerate((None, 0, 3, 5, 6, 9, 11), start=1):
        trainer.step = step
        Trainer.report_alloc_retries(trainer, {"alloc_retries": retries, "reserved_memory_gib": 79.5})
    assert len(lines) == 2 and trainer.reported_retries == 6
    assert "3 CUDA allocation retries by step 3" in lines[0] and "79.50 of 80.00 GiB" in lines[0]
    assert "6 CUDA allocation retries by step 5" in lines[1]
