"""Export a training checkpoint as a Hugging Face Llama directory (config.json + safetensors).

    python scripts/export_hf.py runs/tiny-eager/checkpoints/step_300 exports/tiny
    python scripts/export_hf.py <checkpoint_dir> <out_dir> --dtype bfloat16 --max-shard-size 2GB

The result loads with `transformers.LlamaForCausalLM.from_pretrained(out_dir)` and, for finetuning,
with `python scripts/train.py checkpoint.init_from=<out_dir>`. config.json and generation_config.json
name the BOS and EOS ids of the tokenizer the checkpoint was trained with, and a Hugging Face
tokenizer's files are written beside the weights (`AutoTokenizer`, `pipeline` load the folder).
"""

import argparse
import re
import sys

import torch

from codatrain.model.hf import DEFAULT_MAX_SHARD_BYTES
from codatrain.train.checkpoint import CheckpointError
from codatrain.train.hf_io import export_checkpoint_to_hf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 500MB, 2GiB)")
    size = int(float(match.group(1)) * UNITS[match.group(2).upper()])
    if size <= 0:  # it would write one file per tensor
        raise argparse.ArgumentTypeError(f"{text!r}: a shard size must be positive (examples: 5GB, 500MB)")
    return size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a checkpoint directory, <run_dir>/checkpoints/step_<n>")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="weight dtype (default: as trained, float32)")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest safetensors file before the weights are sharded (default 5GB)")
    args = parser.parse_args(argv)
    try:
        cfg = export_checkpoint_to_hf(
            args.checkpoint, args.out_dir, dtype=DTYPES.get(args.dtype), max_shard_bytes=args.max_shard_size
        )
    except (CheckpointError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk, a read-only folder: one line, not a traceback
        print(f"error: cannot write {args.out_dir}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(f"exported {args.checkpoint} ({cfg.num_params() / 1e6:.1f}M parameters) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
