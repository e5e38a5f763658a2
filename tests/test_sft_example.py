"""The README's finetuning example, end to end with fewer steps: pretrain, export, finetune from the
export on the shipped instructions, export again; the finetuned export predicts held-out assistant
tokens better than the one it started from."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from codatrain.config import load_config, validate
from codatrain.data import build_loaders
from codatrain.data.sft import read_local_records, to_messages
from codatrain.model.llama import IGNORE_INDEX

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "tests" / "data" / "sft_tiny.jsonl"


def readme_commands() -> list[list[str]]:
    """The commands of the README block that finetunes on the shipped file."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    block = next(b for b in blocks if "data=sft data.path=tests/data/sft_tiny.jsonl" in b)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def shortened(command: list[str]) -> list[str]:
    """The command run from any directory, with 4 pretraining and 12 finetuning steps."""
    out = [sys.executable if command[0] == "python" else command[0]]
    finetune = "data=sft" in command
    steps = 12 if finetune else 4
    for arg in command[1:]:
        arg = arg.replace("scripts/", f"{REPO}/scripts/", 1) if arg.startswith("scripts/") else arg
        arg = arg.replace("tests/data/", f"{REPO}/tests/data/")
        arg = re.sub(r"train\.steps=\d+", f"train.steps={steps}", arg)
        arg = re.sub(r"train\.val_every=\d+", f"train.val_every={steps}", arg)
        out.append(arg)
    if "scripts/train.py" in out[1]:
        out += ["train.progress=false", "optim.warmup_steps=2"]
    return out


def test_the_shipped_examples_are_valid_records():
    records = list(read_local_records(str(EXAMPLES)))
    assert len(records) == 400
    for where, record in records:
        to_messages(record, where)


def held_out_loss(hf_dir: Path, val_batches) -> float:
    model = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in val_batches:
            logits = model(input_ids=batch.inputs).logits
            total += F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += (batch.targets != IGNORE_INDEX).sum().item()
    return total / count


@pytest.mark.slow
def test_readme_finetuning_example(tmp_path):
    commands = readme_commands()
    assert [c[1] for c in commands] == ["scripts/train.py", "scripts/export_hf.py"] * 2
    exports = []
    for command in commands:
        # Steps in the checkpoint paths follow the shortened runs.
        command = [re.sub(r"step_\d+", "step_4" if "runs/tiny/" in a else "step_12", a) for a in command]
        proc = subprocess.run(shortened(command), cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if "export_hf.py" in command[1]:
            exports.append(tmp_path / command[-1])
        if "data=sft" in command:
            log = (tmp_path / "runs/tiny-sft/train.log").read_text()
            assert "initialised weights from exports/tiny" in log
            assert re.search(r"training data: \d+ examples \(the plain template\) in \d+ windows", log)
            records = [json.loads(line) for line in (tmp_path / "runs/tiny-sft/metrics.jsonl").open()]
            assert any("val_loss" in r for r in records)

    # The finetuning run's held-out examples, read as the run read them.
    sft_command = next(c for c in commands if "data=sft" in c)
    overrides = [a for a in shortened(sft_command)[2:] if a.startswith("data")]
    run = validate(load_config(overrides))
    _, val = build_loaders(run.data, 8, 0, 1, run.train.seed, "cpu", max_seq_len=1024, model_vocab_size=512)
    val_batches = list(val)
    before, after = (held_out_loss(d, val_batches) for d in exports)
    assert after < 0.9 * before, (before, after)
