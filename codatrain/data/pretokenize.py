"""Offline tokenization into a token directory (token_shards.py), over processes and machines.

The output has a fixed number of shards (by default one per input shard: file or Hub shard), each
a pure function of the source, the tokenizer and its index, so the directory, and the training
batches read from it, are the same whether 1 process or 100 on 10 machines wrote it. Machine m of
M takes the shards i with i mod M = m, its processes take those one at a time, and a shard already
finished (its marker exists) is skipped, so a failed machine is re-run alone. Nothing is locked:
no two writers ever share a shard.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from codatrain.data.config import DataConfig, OnBadData
from codatrain.data.loader import data_sources
from codatrain.data.token_shards import check_joins, shard_name, shard_spec, tokenize_shard
from codatrain.data.tokenizer import load_tokenizer


@dataclass(frozen=True)
class ShardResult:
    index: int
    marker: dict[str, Any]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(part["num_tokens"] for part in self.marker["parts"].values())


def default_shards(cfg: DataConfig) -> int:
    """The source's own number of shards (files, or the Hub dataset's shards)."""
    return data_sources(cfg)[0].stream().num_shards


def _tokenize_one(cfg: DataConfig, out: str, index: int, count: int) -> ShardResult:
    started = time.perf_counter()
    main, _ = data_sources(cfg)
    marker = tokenize_shard(main, load_tokenizer(cfg.tokenizer), Path(out), index, count, cfg.val_fraction,
                            skip_bad=cfg.on_bad_data == OnBadData.skip)
    return ShardResult(index, marker, time.perf_counter() - started)


def tokenize_to_dir(cfg: DataConfig, out: str | Path, shards: int, processes: int, machine: int = 0,
                    machines: int = 1, on_done=None) -> list[ShardResult]:
    """Write this machine's unfinished shards of `shards` into `out` with `processes` processes
    (one core each); `on_done(result)` is called as each finishes. Returns the shards written."""
    if cfg.val_path or cfg.val_split:
        raise ValueError("scripts/tokenize_corpus.py holds validation documents out of the source "
                         "(data.val_fraction); tokenize a separate validation set into its own directory")
    if not 0 <= machine < machines or shards <= 0 or processes <= 0:
        raise ValueError(f"need 0 <= machine ({machine}) < machines ({machines}), shards ({shards}) > 0 "
                         f"and processes ({processes}) > 0")
    # Opening the stream here checks the source, and imports once what `datasets` streams with
    # (~1 s of modules), which forked workers then start with.
    source = data_sources(cfg)[0]
    source.stream()
    check_joins(Path(out), shard_spec(source, load_tokenizer(cfg.tokenizer), cfg.val_fraction), shards)
    todo = [i for i in range(machine, shards, machines)
            if not (Path(out) / f"shard-{shard_name(i, shards)}.json").is_file()]
    results = []
    # One process is one forked worker too, so the 1-process rate is that of the same worker.
    with ProcessPoolExecutor(processes, mp_context=get_context("fork"), initializer=_one_core) as pool:
        futures = [pool.submit(_tokenize_one, cfg, str(out), index, shards) for index in todo]
        for future in futures:
            results.append(future.result())
            if on_done:
                on_done(results[-1])
    return results


def _one_core() -> None:
    """A worker's initializer, before it loads a tokenizer: `tokenizers` runs encode_batch on a Rayon
    pool of every core, so N workers would each try to use the whole machine."""
    os.environ.update(TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
