"""torchao's float8 training of the eager model's layer GEMMs (`train.float8`): the FP8 peer that
the benchmarks put beside CODA, applied as torchtitan applies it.

Every `nn.Linear` of the blocks becomes torchao's `Float8Linear` (dynamic scaling, per tensor or
per row: torchao's `tensorwise` and `rowwise` recipes); the LM head stays in the compute dtype, as
torchtitan leaves it, and so does any layer whose widths are not multiples of 16 (FP8 GEMMs need
them). Applied to the model on the meta device, before torch.compile and FSDP2. On a CPU torchao
emulates the FP8 GEMMs (slow, for tests and debugging); on a GPU they need compute capability 8.9
(Ada, Hopper) or newer.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

RECIPES = ("tensorwise", "rowwise")
# torchao's FP8 GEMMs (torch._scaled_mm) need both widths of a layer in multiples of 16.
FP8_WIDTH_MULTIPLE = 16


def float8_problem(recipe: str, impl: str, device: torch.device | None) -> str | None:
    """Why `train.float8=<recipe>` cannot run with block=`impl` on `device`, or None."""
    if recipe == "none":
        return None
    if impl != "eager":
        return (f"train.float8={recipe} converts the eager model's linear layers (block=eager, the "
                f"benchmarks' FP8 peer), not block={impl}")
    if importlib.util.find_spec("torchao") is None:
        return f"train.float8={recipe} needs torchao: pip install 'codatrain[float8]'"
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"train.float8={recipe} needs a GPU of compute capability 8.9 or newer, not {major}.{minor}"
    return None


def apply_float8(model: nn.Module, recipe: str, emulate: bool) -> list[str]:
    """Convert the layer GEMMs of `model` (an eager Llama) to torchao's float8 training with
    `recipe`; `emulate`: FP8 GEMMs emulated in higher precision (a CPU). Returns the names of the
    layers converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(str(recipe)), emulate=emulate)
    converted = []

    def convert(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or name == "lm_head":
            return False
        if module.in_features % FP8_WIDTH_MULTIPLE or module.out_features % FP8_WIDTH_MULTIPLE:
            return False
        converted.append(name)
        return True

    convert_to_float8_training(model, config=config, module_filter_fn=convert)
    return converted
