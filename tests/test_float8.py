"""train.float8: torchao's float8 training of the eager model's layer GEMMs, the benchmarks' FP8
peer (codatrain/train/float8.py). On the CPU torchao emulates the FP8 GEMMs, so the user's path
(scripts/train.py's `train`) runs here."""

import pytest
import torch
from torch import nn

from codatrain.config import load_config, validate
from codatrain.train.distributed import init_distributed
from codatrain.train.plan import build_run_plan
from codatrain.train.trainer import Trainer, train

FAST = ["train.log_every=1", "train.val_every=0", "train.progress=false", "checkpoint.at_end=false",
        "data=synthetic", "model.vocab_size=256", "train.steps=20"]


def test_float8_converts_the_layer_gemms_and_trains_like_bf16(tmp_path):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    plain = train(load_config([*FAST, f"train.run_dir={tmp_path / 'plain'}"])).losses
    cfg = load_config([*FAST, f"train.run_dir={tmp_path / 'fp8'}", "train.float8=rowwise"])
    run = Trainer(validate(cfg), init_distributed("cpu"))
    layers = dict(run.model.named_modules())
    fp8 = {name for name, module in layers.items() if isinstance(module, Float8Linear)}
    assert fp8 == {name for name, module in layers.items() if isinstance(module, nn.Linear)} - {"lm_head"}
    assert type(layers["lm_head"]) is nn.Linear and len(fp8) == 4 * run.model_cfg.n_layers
    assert "float8 rowwise (torchao)" in run.plan.header()[0]
    losses = run.fit().losses
    run.close()
    # FP8 rounds every layer GEMM's operands to 3 mantissa bits: the same descent, not the same numbers.
    assert losses[1] == pytest.approx(plain[1], rel=1e-2)
    assert losses[20] == pytest.approx(plain[20], rel=0.1) and losses[20] < losses[1] - 0.5
    assert losses != plain


@pytest.mark.parametrize("overrides, refusal", [
    (["block=coda"], r"^train.float8=tensorwise converts the eager model's linear layers \(block=eager, "
                     r"the benchmarks' FP8 peer\), not block=coda$"),
    (["block=liger"], r"not block=liger$"),
])
def test_float8_is_refused_where_it_does_not_apply(overrides, refusal):
    cfg = validate(load_config(["train.float8=tensorwise", *overrides]))
    with pytest.raises(ValueError, match=refusal):
        build_run_plan(cfg, torch.device("cpu"))
