"""Tokenize a corpus offline into a token directory that `data=tokens` memory-maps.

    python scripts/tokenize_corpus.py data=files data.path=/data/corpus data.tokenizer=/models/Llama-3.2-1B \\
        --out /data/tokens --processes 16
    # or over 4 machines sharing /data (each takes shards i with i mod 4 = its index):
    python scripts/tokenize_corpus.py data=hub data.path=HuggingFaceFW/fineweb-edu data.name=sample-10BT \\
        data.tokenizer=/models/Llama-3.2-1B --out /data/tokens --shards 512 --machine 2 --machines 4
    python scripts/train.py data=tokens data.path=/data/tokens data.tokenizer=/models/Llama-3.2-1B

Takes the data overrides of scripts/train.py (data.source, path, text_column, tokenizer,
val_fraction: documents held out by content go to the directory's validation part, on_bad_data).
Options: --out DIR; --shards N output shards (default: the source's files or Hub shards; keep it
the same on every machine); --processes N (default: every core); --machine I --machines M.
Finished shards are skipped, so re-running after a failure only does what is left.
"""

import argparse
import os
import sys
import time

from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from codatrain.config import load_config, unknown_override_key, validate
from codatrain.data.pretokenize import default_shards, tokenize_to_dir


def main(argv: list[str]) -> int | str:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="data overrides, as for scripts/train.py")
    parser.add_argument("--out", required=True, help="the token directory to write")
    parser.add_argument("--shards", type=int, default=None, help="output shards (default: the source's)")
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="tokenizing processes")
    parser.add_argument("--machine", type=int, default=0, help="this machine's index")
    parser.add_argument("--machines", type=int, default=1, help="machines sharing the work")
    args = parser.parse_intermixed_args(argv)
    if (unknown := unknown_override_key(args.overrides)) is not None:  # as scripts/train.py names it
        return f"error: {unknown}"
    try:
        cfg = load_config(args.overrides)
        validate(cfg)
        data = OmegaConf.to_object(cfg).data
        shards = args.shards or default_shards(data)
        started = time.perf_counter()

        def done(result) -> None:
            parts = ", ".join(f"{p} {v['num_tokens']:,} tokens / {v['num_documents']:,} documents"
                              for p, v in result.marker["parts"].items())
            print(f"shard {result.index + 1}/{shards}: {parts}, {result.marker['skipped_rows']} bad rows "
                  f"skipped, {result.seconds:.1f} s", flush=True)

        results = tokenize_to_dir(data, args.out, shards, args.processes, args.machine, args.machines, done)
    except (ValueError, FileNotFoundError, ConfigCompositionException) as error:
        return f"error: {error}"
    if not results:
        print(f"nothing to do: {args.out} holds this machine's shards of {shards} already")
        return 0
    seconds = time.perf_counter() - started
    tokens = sum(r.tokens for r in results)
    print(f"{len(results)} shards, {tokens:,} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):,.0f} "
          f"tokens/s) with {args.processes} processes into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
