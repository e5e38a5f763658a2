"""Data pipeline benchmark on CPU: offline tokenization, loader throughput, time to the first batch.

    python scripts/bench_data.py --work /tmp/bench_data --mb 20

Writes a synthetic English-like JSONL corpus (`--mb` MB in `--files` files) and a 10× copy of it,
trains a byte-level BPE tokenizer on a sample (`--vocab`, or pass `--tokenizer` a tokenizer.json),
then measures:

- offline tokens/s of scripts/tokenize_corpus.py's work (`tokenize_to_dir`) with 1, 2 and all cores
  (best of `--repeats`), with the cores its workers kept busy, its tokens per CPU-second, and the
  cores as many spinning processes got just before it and the load average: on a shared machine
  the parallel rate is bounded by the cores the other jobs leave;
- loader tokens/s of one rank from the token directory (data=tokens) and from the stream
  (data.streaming=true, default data.num_workers), batches of `--batch` × `--seq-len`;
- time to the first batch (build_loaders → first batch: the part of a run's start that depends on
  the corpus) and the loader process's peak RSS, for the corpus and the 10× corpus, both paths.
"""

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from codatrain.data import build_loaders
from codatrain.data.config import DataConfig, DataSource
from codatrain.data.pretokenize import tokenize_to_dir


def write_corpus(folder: Path, mb: float, files: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    words = np.array(["".join(rng.choice(list("etaoinshrdlucmfwypvbgkjqxz"), size=n))
                      for n in rng.integers(2, 9, 5000)])
    folder.mkdir(parents=True, exist_ok=True)
    per_file = int(mb * 2**20 / files)
    for f in range(files):
        with open(folder / f"part{f:04d}.jsonl", "w") as out:
            written = 0
            while written < per_file:
                text = " ".join(words[rng.zipf(1.3, rng.integers(100, 1500)) % len(words)])
                line = json.dumps({"text": text}) + "\n"
                out.write(line)
                written += len(line)


def ten_times(folder: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for copy in range(10):
        for file in sorted(folder.glob("*.jsonl")):
            shutil.copyfile(file, target / f"c{copy}-{file.name}")


def train_tokenizer(folder: Path, vocab: int, out: Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    sample = [json.loads(line)["text"] for line in open(next(folder.glob("*.jsonl")))][:2000]
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=vocab,
                                                              special_tokens=["<s>", "</s>"]))
    tokenizer.save(str(out))
    return str(out)


def children_cpu_seconds() -> float:
    """CPU time of this process's finished children: tokenize_to_dir's workers, whose share of the
    machine's cores tells a slow parallel run from a machine busy with other jobs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def available_cores(processes: int, seconds: float = 1.0) -> float:
    """The cores that `processes` spinning processes get from this machine now: on a shared machine
    the other jobs take the rest, and no tokenizer can scale past it."""
    cpu, started, pids = children_cpu_seconds(), time.perf_counter(), []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            while time.perf_counter() < started + seconds:
                pass
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return (children_cpu_seconds() - cpu) / (time.perf_counter() - started)


def first_batch(cfg: DataConfig, batch: int) -> tuple[float, object]:
    started = time.perf_counter()
    train, _ = build_loaders(cfg, batch, 0, 1, 0, "cpu", max_seq_len=cfg.seq_len,
                             model_vocab_size=1 << 17)
    iterator = iter(train)
    next(iterator)
    return time.perf_counter() - started, iterator


def loader_rate(iterator, batches: int, tokens_per_batch: int) -> float:
    started = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * tokens_per_batch / (time.perf_counter() - started)


def measure_loader(cfg: DataConfig, batch: int, batches: int) -> dict:
    """In a child process, so that its peak RSS is the loader's own."""
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        ttfb, iterator = first_batch(cfg, batch)
        rate = loader_rate(iterator, batches, batch * cfg.seq_len)
        # Stops the DataLoader's workers, which would otherwise outlive os._exit, holding the pipe.
        iterator.close()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
        result = {"first_batch_s": ttfb, "tokens_per_s": rate, "peak_rss_mib": rss}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        result = json.loads(pipe.read())
    os.wait()
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/bench_data", help="scratch directory")
    parser.add_argument("--mb", type=float, default=20, help="corpus size in MB (the large one is 10x)")
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: train a BPE)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1, help="offline runs per process count (best kept)")
    args = parser.parse_args(argv)
    work = Path(args.work)
    small, large = work / "corpus", work / "corpus10x"
    reused = small.is_dir()
    if not reused:
        write_corpus(small, args.mb, args.files)
    # A corpus an earlier call wrote is measured as it is: its own files, not --mb and --files.
    num_files = len(list(small.glob("*.jsonl")))
    if not large.is_dir():
        ten_times(small, large)
    tokenizer = args.tokenizer or train_tokenizer(small, args.vocab, work / "tokenizer.json")
    cores = os.cpu_count()
    print(f"{cores} cores; corpus {sum(f.stat().st_size for f in small.iterdir()) / 2**20:.1f} MiB in "
          f"{num_files} files" + (f" (written by an earlier call into {work}; --mb and --files apply to a "
                                  "new --work)" if reused else "") + f"; tokenizer {tokenizer}")

    def files(path: Path, **extra) -> DataConfig:
        return DataConfig(source=DataSource.files, path=str(path), tokenizer=tokenizer, val_fraction=0.0,
                          seq_len=args.seq_len, **extra)

    rates = {}
    for processes in sorted({1, 2, cores}):
        out = work / f"tokens_p{processes}"
        runs = []
        for _ in range(args.repeats):
            shutil.rmtree(out, ignore_errors=True)
            load, free = os.getloadavg()[0], available_cores(processes)
            cpu, started = children_cpu_seconds(), time.perf_counter()
            results = tokenize_to_dir(files(small), out, shards=num_files, processes=processes)
            seconds, cpu = time.perf_counter() - started, children_cpu_seconds() - cpu
            runs.append((sum(r.tokens for r in results) / seconds, cpu / seconds, free, load))
        rate, busy, free, load = max(runs)
        rates[processes] = rate
        target = 0.8 * processes * rates[1]
        print(f"offline tokenization, {processes} processes: {rate:,.0f} tokens/s ({rate / rates[1]:.2f}x "
              f"the 1-process rate; target 0.8 x {processes} x the 1-process rate = {target:,.0f}); "
              f"{busy:.2f} cores busy, {rate / busy:,.0f} tokens per CPU-second; just before it "
              f"{processes} spinning processes got {free:.2f} cores, load average {load:.2f} "
              f"(best of {args.repeats})", flush=True)
    large_tokens = work / "tokens10x"
    if not large_tokens.is_dir():
        tokenize_to_dir(files(large), large_tokens, shards=10 * num_files, processes=cores)
    rows = []
    for name, corpus, tokens in (("corpus", small, work / f"tokens_p{cores}"),
                                 ("10x corpus", large, large_tokens)):
        shards = DataConfig(source=DataSource.tokens, path=str(tokens), tokenizer=tokenizer,
                            seq_len=args.seq_len)
        for path, cfg in (("tokens", shards), ("stream", files(corpus, streaming=True))):
            result = measure_loader(cfg, args.batch, args.batches)
            rows.append((name, path, result))
            print(f"{name}, {path}: first batch {result['first_batch_s']:.2f} s, "
                  f"{result['tokens_per_s']:,.0f} tokens/s per rank, "
                  f"peak RSS {result['peak_rss_mib']:.0f} MiB", flush=True)
    for path in ("tokens", "stream"):
        small_s, large_s = (r["first_batch_s"] for _, p, r in rows if p == path)
        print(f"{path}: time to first batch, 10x corpus / corpus = {large_s / small_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
