"""Generate text with the eager Llama from a training checkpoint or a Hugging Face Llama folder.

    python scripts/generate.py runs/tiny-eager/checkpoints/step_300 --prompt "The Python"
    python scripts/generate.py exports/tiny --prompt "def " --temperature 0.8 --top-p 0.9 --seed 1
    python scripts/generate.py runs/tiny-sft/checkpoints/step_100 --chat --prompt "What is 2 plus 3?"

Greedy by default (--temperature 0). The tokenizer is the one the weights were trained with: the
one a training checkpoint records, or an HF folder's own (tokenizer.json or tokenizer_config.json),
else the byte tokenizer; --tokenizer names another (`byte`, a tokenizer.json or a tokenizer folder),
as `data.tokenizer` does in training.

--chat asks for the assistant's reply to the prompt as a user message, rendered as fine-tuning
renders conversations (data=sft): with the tokenizer's chat template where it has one, else the
plain template; it prints the reply only.
"""

import argparse
import math
import os
import sys

import torch

from codatrain.data.sft import generation_prompt
from codatrain.data.tokenizer import check_vocab, load_tokenizer
from codatrain.model import Llama
from codatrain.model.generate import generate
from codatrain.model.hf import hub_id_hint
from codatrain.train.checkpoint import CheckpointError, inspect_checkpoint
from codatrain.train.hf_io import is_checkpoint, load_init_weights, saved_architecture, saved_tokenizer


def load_model(path: str, device: str) -> Llama:
    """The eager model with the weights of a codatrain checkpoint (config from its manifest) or of
    an HF Llama folder (config from its config.json)."""
    manifest = inspect_checkpoint(path) if is_checkpoint(path) else None
    cfg = saved_architecture(path)
    with torch.device("meta"):  # every weight is loaded, so none is initialised first
        model = Llama(cfg)
    model.to_empty(device=device)
    load_init_weights(model, path, cfg, log=lambda line: print(line, file=sys.stderr), manifest=manifest)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", help="a checkpoint directory or a Hugging Face Llama folder")
    parser.add_argument("--prompt", default="", help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer", default=None,
                        help="byte | a tokenizer.json or tokenizer folder (default: see above)")
    parser.add_argument("--chat", action="store_true",
                        help="the prompt is a user message; print the assistant's reply (see above)")
    args = parser.parse_args(argv)
    check_sampling(parser, args)
    try:
        check_device(args.device)
        if not os.path.exists(args.path):  # before a tokenizer line that would not apply
            raise FileNotFoundError(f"{args.path}: no such file or directory{hub_id_hint(args.path)}")
        tokenizer_spec = args.tokenizer or saved_tokenizer(args.path) or "byte"
        tokenizer = load_tokenizer(tokenizer_spec,
                                   setting="--tokenizer" if args.tokenizer else "saved with the weights")
        if args.chat:
            prompt_ids, template = generation_prompt([{"role": "user", "content": args.prompt}],
                                                     tokenizer_spec, tokenizer)
        else:
            prompt_ids = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
            prompt_ids += tokenizer.encode_batch([args.prompt])[0].tolist()
        if not prompt_ids:  # no position to predict from: the model's forward failed on an empty batch
            raise ValueError(f"tokenizer {tokenizer_spec} has no BOS token to start from, so an empty prompt "
                             "leaves nothing to continue; give --prompt")
        print(f"tokenizer: {tokenizer_spec}" + (f", {template}" if args.chat else ""), file=sys.stderr)
        model = load_model(args.path, args.device)
        setting = "--tokenizer" if args.tokenizer else "saved with the weights"
        check_vocab(tokenizer.vocab_size, model.cfg.vocab_size, f"tokenizer {tokenizer_spec} ({setting})")
        # The KV cache holds prompt and reply, at most max_seq_len positions: past it, generate()'s
        # ValueError was a traceback about a cache the user never sized.
        room = model.cfg.max_seq_len - len(prompt_ids)
        if args.max_new_tokens > room:
            ask = (f"--max-new-tokens {room} at most" if room > 0
                   else f"a prompt of fewer than {model.cfg.max_seq_len} tokens")
            raise ValueError(
                f"the prompt's {len(prompt_ids)} tokens and --max-new-tokens {args.max_new_tokens} need "
                f"{len(prompt_ids) + args.max_new_tokens} positions, more than the model's "
                f"max_seq_len={model.cfg.max_seq_len}; ask for {ask}"
            )
    except (CheckpointError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    generator = torch.Generator(args.device).manual_seed(args.seed)
    tokens = generate(
        model, torch.tensor([prompt_ids], device=args.device), args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, generator=generator, eos_id=tokenizer.eos_id,
    )[0].tolist()
    # Decoded whole (a word tokenizer spaces the joint), or the reply alone.
    print(tokenizer.decode(tokens[len(prompt_ids):] if args.chat else tokens))
    return 0


def check_sampling(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with argparse's usage error for sampling settings `generate` cannot use, before any load."""
    if args.max_new_tokens < 0:
        parser.error(f"argument --max-new-tokens: must be 0 or more, got {args.max_new_tokens}")
    if not 0 <= args.temperature < math.inf:
        parser.error(f"argument --temperature: must be 0 (greedy) or positive, got {args.temperature}")
    if not 0 <= args.top_p <= 1:
        parser.error(f"argument --top-p: must be in [0, 1], got {args.top_p}")


def check_device(device: str) -> None:
    """ValueError, in one line, for a device this machine does not have (before any is touched)."""
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"--device {device}: {error}") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device}: no CUDA device is available here; use --device cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to "
                             f"cuda:{count - 1}")


if __name__ == "__main__":
    sys.exit(main())
