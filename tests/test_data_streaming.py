"""Streaming (data.streaming=true) and token directories (scripts/tokenize_corpus.py, data=tokens): exact
resume, packing equal to the stored path, one pass over every document per epoch on 2 processes,
bad rows named and skipped or fatal, and token directories independent of the process count."""

import dataclasses
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_checkpoint_resume import FAST, Crash, crash_on_step_call
from test_data_sources import word_tokenizer

from codatrain.config import load_config
from codatrain.data import build_loaders, pretokenize
from codatrain.data.config import DataConfig, DataSource, OnBadData
from codatrain.data.loader import data_sources
from codatrain.data.pretokenize import tokenize_to_dir
from codatrain.data.sources import DataFileError, held_out_by_content
from codatrain.data.streaming import CHUNK_ROWS
from codatrain.data.token_shards import shard_name
from codatrain.data.tokenizer import load_tokenizer
from codatrain.train import checkpoint
from codatrain.train.checkpoint_files import write_json
from codatrain.train.trainer import train

BOS, EOS = 256, 257

REPO = Path(__file__).resolve().parent.parent


def corpus(folder, files=4, per_file=12):
    """Files of documents named `doc <file>-<i>`, of varied lengths."""
    folder.mkdir(exist_ok=True)
    texts = []
    for f in range(files):
        rows = [f"doc {f}-{i} " + "words " * ((i * 7 + f) % 9 + 1) for i in range(per_file)]
        (folder / f"part{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
        texts += rows
    return texts


def stream_config(path, **overrides):
    values = dict(source=DataSource.files, path=str(path), streaming=True, seq_len=16, val_fraction=0.0,
                  keep_document_boundaries=True, num_workers=0)
    return DataConfig(**{**values, **overrides})


def build(cfg, batch_size=2, rank=0, world_size=1):
    return build_loaders(cfg, batch_size, rank, world_size, 0, "cpu", max_seq_len=64, model_vocab_size=512)


def take(loader, n):
    iterator = iter(loader)
    return [next(iterator) for _ in range(n)]


def same(a, b):
    return all(torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
               and torch.equal(x.documents.doc_index, y.documents.doc_index)
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("workers,shuffle_buffer", [(0, 256), (2, 256), (0, 3), (0, 0)])
def test_stream_resumes_exactly_mid_buffer_and_across_epochs(tmp_path, workers, shuffle_buffer):
    """Resumed mid-batch, mid-pool (a shuffle pool of 3 holds up to 3 + CHUNK_ROWS documents) and
    across epochs, the stream gives the uninterrupted run's batches."""
    corpus(tmp_path / "c")
    cfg = stream_config(tmp_path / "c", num_workers=workers, shuffle_buffer=shuffle_buffer)
    reference = take(build(cfg)[0], 60)  # about three epochs of each reader
    for stop in (3, 7, 31):
        first = build(cfg)[0]
        take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
        resumed = build(cfg)[0]
        resumed.load_state_dict(state)
        assert same(take(resumed, 60 - stop), reference[stop:]), stop


def test_each_worker_reads_its_own_part_of_the_stream(tmp_path):
    """With 2 workers, batches 0 and 1 come from readers 0 and 1, whose parts are different files."""
    corpus(tmp_path / "c")
    batches = take(build(stream_config(tmp_path / "c", num_workers=2, shuffle_buffer=0))[0], 2)
    texts = [bytes(b.inputs[b.inputs < 256].tolist()) for b in batches]
    files = [{name[4] for name in re.findall(rb"doc \d-", text)} for text in texts]
    assert all(files) and not files[0] & files[1], files
    # Reader j of rank 0 reads shards j, j + 2, ...: each starts with its first file's first document.
    assert texts[0].startswith(b"doc 0-0 ") and texts[1].startswith(b"doc 1-0 ")


def test_a_resume_with_three_workers_continues_with_the_reader_whose_turn_it_is(tmp_path):
    corpus(tmp_path / "c", files=3)
    cfg = stream_config(tmp_path / "c", num_workers=3, shuffle_buffer=0)
    reference = take(build(cfg)[0], 4)
    first = build(cfg)[0]
    take(first, 1)
    resumed = build(cfg)[0]
    resumed.load_state_dict(first.state_dict())
    assert same(take(resumed, 3), reference[1:])


def test_stream_state_saved_before_the_shuffle_pool_resumes_exactly(tmp_path):
    corpus(tmp_path / "c")
    cfg = stream_config(tmp_path / "c", shuffle=False)
    reference = take(build(cfg)[0], 60)
    first = build(cfg)[0]
    batches = iter(first)
    next(batches)
    while first.state_dict()["reader_states"][0]["pool_lengths"]:  # until nothing is read ahead,
        next(batches)  # as in the states of older versions
    stop, state = first.batches, first.state_dict()
    assert 0 < stop < 60
    for key in ("pool", "pool_lengths", "rng"):
        del state["reader_states"][0][key]
    resumed = build(cfg)[0]
    resumed.load_state_dict(state)
    assert same(take(resumed, 60 - stop), reference[stop:])


def test_stream_packs_the_windows_the_stored_path_packs(tmp_path):
    corpus(tmp_path / "c")
    stored = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), seq_len=16, val_fraction=0.0,
                        keep_document_boundaries=True, shuffle=False, num_workers=0,
                        cache_dir=str(tmp_path / "cache"))
    stream = take(build(stream_config(tmp_path / "c", shuffle=False))[0], 10)
    assert same(stream, take(build(stored)[0], 10))
    # torch.equal does not compare dtypes
    assert {(b.documents.doc_index.dtype, b.documents.cu_seqlens.dtype) for b in stream} == \
        {(torch.int64, torch.int32)}


def test_short_documents_keep_their_boundaries_where_a_refill_takes_several(tmp_path):
    """Documents shorter than a window: each refill of the reader takes several, and every one of
    them starts a document in the doc ids, as the stored path packs them."""
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "part0.jsonl").write_text("".join(json.dumps({"text": f"d{i}" + " x" * (i % 3)}) + "\n"
                                                for i in range(200)))
    cfg = dict(seq_len=32, shuffle=False)
    stored = DataConfig(source=DataSource.files, path=str(folder), val_fraction=0.0,
                        keep_document_boundaries=True, num_workers=0, cache_dir=str(tmp_path / "cache"),
                        **cfg)
    stream = take(build(stream_config(folder, **cfg))[0], 8)
    assert max(int(b.documents.doc_index.max()) for b in stream) >= 3  # several documents in a window
    assert same(stream, take(build(stored)[0], 8))


def test_a_stream_is_tokenized_with_the_runs_tokenizer_from_epoch_0(tmp_path):
    tok, vocab = word_tokenizer(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = ["hello world the quick", "brown fox jumps over the lazy dog"] * 4
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    loader = build(stream_config(tmp_path / "c", tokenizer=str(tmp_path / "tokenizer.json"), seq_len=8,
                                 shuffle=False))[0]
    batch = take(loader, 1)[0]
    ids = sum(([vocab["<s>"], *(vocab[w] for w in t.split()), vocab["</s>"]] for t in texts), [])
    assert batch.inputs.tolist() == [ids[:8], ids[8:16]]
    # Epochs count from 0 by 1, as the shuffle's seed and the checkpointed state name them.
    assert loader.state_dict()["reader_states"][0]["epoch"] == 0
    take(loader, 4)  # 81 tokens: into the second pass over the 60 of the file
    assert loader.state_dict()["reader_states"][0]["epoch"] == 1


def test_a_stream_without_document_boundaries_gives_no_document_ids(tmp_path):
    corpus(tmp_path / "c")
    batch = take(build(stream_config(tmp_path / "c", keep_document_boundaries=False))[0], 1)[0]
    assert batch.documents is None


def test_streamed_training_skips_the_held_out_documents(tmp_path):
    texts = corpus(tmp_path / "c", files=1, per_file=40)
    held = {t for t in texts if held_out_by_content(t, 0.25)}
    assert 0 < len(held) < 20
    loader = build(stream_config(tmp_path / "c", val_fraction=0.25, val_tokens=1 << 12, shuffle=False))[0]
    streamed = b"".join(bytes(b.inputs[b.inputs < 256].tolist()) for b in take(loader, 80)).decode()
    read = set(re.findall(r"doc 0-\d+ ", streamed))
    assert read == {t.split("words")[0] for t in texts if t not in held}


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reader_whose_part_of_the_stream_is_empty_is_named(tmp_path, workers):
    """In one line: from a worker it was 'Caught ValueError in DataLoader worker process 0.' and the
    worker's traceback, which the train script printed after `error:` (and a restart as the error)."""
    corpus(tmp_path / "c", files=1, per_file=1)
    where = r" \(in DataLoader worker process 0\)" if workers else ""
    with pytest.raises(ValueError, match=r"^[^\n]*: reader 0 of rank 1 found no documents in epoch 0 of its "
                                         r"part \(1/2 of the stream\); the source has too few documents or "
                                         rf"shards for the ranks × data.num_workers{where}$"):
        take(build(stream_config(tmp_path / "c", num_workers=workers), rank=1, world_size=2)[0], 1)


def test_a_stream_whose_documents_are_all_held_out_names_val_fraction(tmp_path):
    """It blamed only the ranks × data.num_workers, which were one."""
    texts = corpus(tmp_path / "c", files=1, per_file=3)
    assert all(held_out_by_content(t, 0.9999) for t in texts)
    with pytest.raises(ValueError, match=r"found no documents .* data.num_workers, or "
                                         r"data.val_fraction=0.9999 holds them out$"):
        take(build(stream_config(tmp_path / "c", val_fraction=0.9999))[0], 1)


def test_streamed_validation_is_the_first_val_tokens_of_its_source_in_the_runs_tokenizer(tmp_path):
    tok, vocab = word_tokenizer(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = ["hello world the quick", "brown fox jumps over the lazy dog"] * 20
    for folder in ("c", "v"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = stream_config(tmp_path / "c", tokenizer=str(tmp_path / "tokenizer.json"), seq_len=8,
                        val_path=str(tmp_path / "v"), val_tokens=50)
    val = build(cfg)[1]
    assert next(iter(val)).inputs.dtype == torch.int64  # token ids, as the embedding takes them
    stream = val._loader.dataset.stream
    ids = sum(([vocab["<s>"], *(vocab[w] for w in t.split()), vocab["</s>"]] for t in texts), [])
    assert stream.read(0, stream.num_tokens).tolist() == ids[:51]  # val_tokens inputs and one target


def test_streamed_validation_without_documents_is_named(tmp_path):
    corpus(tmp_path / "c")
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    for overrides, reason in (({"val_path": str(tmp_path / "v")}, ""),
                              ({"val_fraction": 1e-9}, r" held out \(data.val_fraction=1e-09\)")):
        val = build(stream_config(tmp_path / "c", val_tokens=64, **{"val_fraction": 0.0} | overrides))[1]
        with pytest.raises(ValueError, match=rf"^the validation data of .* has no documents{reason}$"):
            next(iter(val))


def test_streamed_validation_reads_its_source_only_as_far_as_val_tokens_need(tmp_path):
    """The first chunk of rows ends at exactly val_tokens tokens: the set still gets its last target
    from the second chunk, and nothing after that is read (a bad row there is never reached)."""
    (tmp_path / "v").mkdir()
    docs = [f"v{i:02d}" for i in range(2 * CHUNK_ROWS)]  # 5 tokens each: BOS, 3 bytes, EOS
    (tmp_path / "v" / "d.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in docs) + "not json\n")
    corpus(tmp_path / "c")
    val = build(stream_config(tmp_path / "c", val_path=str(tmp_path / "v"), val_tokens=5 * CHUNK_ROWS,
                              seq_len=4))[1]
    next(iter(val))
    stream = val._loader.dataset.stream
    expected = [t for d in docs for t in (BOS, *d.encode(), EOS)][:5 * CHUNK_ROWS + 1]
    assert stream.read(0, stream.num_tokens).tolist() == expected


def test_a_state_of_stored_windows_is_refused_by_a_stream(tmp_path):
    corpus(tmp_path / "c")
    stored = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), seq_len=16, val_fraction=0.0,
                        num_workers=0, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"^the training data state was saved by a loader of stored "
                                         r"windows, not a stream \(data.streaming changed\); it cannot "
                                         r"continue exactly$"):
        build(stream_config(tmp_path / "c"))[0].load_state_dict(build(stored)[0].state_dict())


def test_state_of_another_reader_count_window_or_world_is_refused_naming_both_values(tmp_path):
    corpus(tmp_path / "c")
    first = build(stream_config(tmp_path / "c", num_workers=2))[0]
    take(first, 3)
    state = first.state_dict()
    refused = [({"num_workers": 1}, {}, "readers=2, but this run has 1", "data.num_workers (its readers)"),
               ({"num_workers": 2, "seq_len": 8}, {}, "seq_len=16, but this run has 8", "seq_len"),
               ({"num_workers": 2}, {"rank": 1, "world_size": 2}, "world_size=1, but this run has 2",
                "world_size")]
    for overrides, ranks, values, what in refused:
        with pytest.raises(ValueError, match=re.escape(
                f"the training stream state was saved with {values}: each reader's place in the stream "
                f"cannot be mapped; resume with the same {what}") + "$"):
            build(stream_config(tmp_path / "c", **overrides), **ranks)[0].load_state_dict(state)


def test_stream_state_says_where_each_reader_stands_as_json(tmp_path):
    corpus(tmp_path / "c")
    loader = build(stream_config(tmp_path / "c", num_workers=2))[0]
    assert loader.state_dict() == {"stream": str(tmp_path / "c"), "seq_len": 16, "world_size": 1,
                                   "readers": 2, "batches": 0, "reader_states": [None, None]}
    take(loader, 3)
    state = loader.state_dict()
    assert state["batches"] == 3 and json.loads(json.dumps(state)) == state  # plain lists, as stored
    assert [s["epoch"] for s in state["reader_states"]] == [0, 0]
    for reader in state["reader_states"]:
        assert all(isinstance(reader[key], list) for key in ("tokens", "starts", "pool", "pool_lengths"))


def test_every_load_of_a_stream_state_stops_the_iterators_made_before_it(tmp_path):
    corpus(tmp_path / "c")
    loader = build(stream_config(tmp_path / "c"))[0]
    state = loader.state_dict()
    loader.load_state_dict(state)
    batches = iter(loader)
    next(batches)
    loader.load_state_dict(state)  # a second load stops an iterator made after the first
    with pytest.raises(RuntimeError, match=re.escape(
            "the training loader's state was loaded during iteration; call iter() on it again") + "$"):
        next(batches)


def test_stream_batches_are_moved_to_the_loaders_device(tmp_path):
    corpus(tmp_path / "c")
    loader = build_loaders(stream_config(tmp_path / "c"), 2, 0, 1, 0, "meta", max_seq_len=64,
                           model_vocab_size=512)[0]
    batch = next(iter(loader))
    documents = batch.documents
    tensors = (batch.inputs, batch.targets, documents.doc_index, documents.cu_seqlens, documents.positions)
    assert {t.device.type for t in tensors} == {"meta"}


def test_a_stream_on_the_cpu_reads_without_warnings(tmp_path):
    corpus(tmp_path / "c")
    loader = build(stream_config(tmp_path / "c"))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. pinning memory on a machine without an accelerator
        next(iter(loader))


def test_kill_and_resume_of_a_streaming_run_matches_the_uninterrupted_run(tmp_path, monkeypatch):
    corpus(tmp_path / "c")
    options = [o for o in FAST if not o.startswith(("data=", "data.num_workers"))] + [
        "data=files", f"data.path={tmp_path / 'c'}", "data.streaming=true", "data.num_workers=1",
        "data.val_fraction=0.2", "data.seq_len=16", "train.val_every=2", "train.val_batches=2",
        "train.tokens_per_step=128"]
    full = train(load_config([*options, f"train.run_dir={tmp_path / 'full'}", "checkpoint.at_end=false"]))
    with monkeypatch.context() as patch:
        crash_on_step_call(patch, 4)  # dies during step 4, after the checkpoint of step 2
        with pytest.raises(Crash):
            train(load_config([*options, f"train.run_dir={tmp_path / 'cut'}", "checkpoint.every=2"]))
    resumed = train(load_config([*options, f"train.run_dir={tmp_path / 'cut'}", "checkpoint.every=2"]))
    assert resumed.losses == {s: full.losses[s] for s in range(3, 9)}
    assert resumed.val_losses == {s: full.val_losses[s] for s in (4, 6, 8)}


def children_of(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a process that ended meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="workers die with their parent through Linux's prctl")
def test_a_killed_streaming_run_leaves_no_workers_and_resumes(tmp_path):
    """SIGKILL of a trainer whose DataLoader workers are blocked on a full pipe (batches larger than
    its 64 KiB): the workers die with it, and the run resumes from its checkpoint."""
    corpus(tmp_path / "c", per_file=100)
    options = [o for o in FAST if not o.startswith(("data=", "data.num_workers", "data.seq_len",
                                                    "train.micro_batch_size", "train.tokens_per_step"))]
    options += ["data=files", f"data.path={tmp_path / 'c'}", "data.streaming=true", "data.num_workers=2",
                "data.val_fraction=0", "data.seq_len=1024", "train.micro_batch_size=4",
                "model.n_layers=1", f"train.run_dir={tmp_path / 'run'}", "checkpoint.every=1"]
    trainer = subprocess.Popen([sys.executable, str(REPO / "scripts/train.py"), *options, "train.steps=1000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        while not (tmp_path / "run/checkpoints/step_2").is_dir():
            assert trainer.poll() is None, trainer.stderr.read()
            time.sleep(0.2)
        workers = children_of(trainer.pid)
        assert len(workers) == 2
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [w for w in workers if alive(w)]
    for orphan in orphans:
        os.kill(orphan, signal.SIGKILL)
    assert not orphans
    resumed = train(load_config([*options, "train.steps=3"]))
    assert list(resumed.losses) == [3]


# A crash in the second training step (an out-of-memory error, say): the workers are alive.
CRASHING_STEP = """
import runpy, sys
from codatrain.train.trainer import Trainer
first_step = Trainer.train_step
def train_step(self, batches):
    if self.step == 1:
        raise RuntimeError("out of memory (a stand-in)")
    return first_step(self, batches)
Trainer.train_step = train_step
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("failure", ["bad row in a worker", "crashed step"])
def test_a_run_that_fails_with_its_workers_alive_exits(tmp_path, failure):
    """The parent used to wait at exit for its workers (alive: their iterator was held by the
    error), and they ignore the SIGTERM multiprocessing ends them with."""
    corpus(tmp_path / "c")
    if failure == "bad row in a worker":
        (tmp_path / "c" / "part1.jsonl").write_text(json.dumps({"content": "no text field"}) + "\n")
    options = [o for o in FAST if not o.startswith(("data=", "data.num_workers"))]
    options += ["data=files", f"data.path={tmp_path / 'c'}", "data.streaming=true", "data.num_workers=2",
                "data.val_fraction=0", "model.n_layers=1", f"train.run_dir={tmp_path / 'run'}"]
    prefix = [] if failure == "bad row in a worker" else ["-c", CRASHING_STEP]
    ended = subprocess.run([sys.executable, *prefix, str(REPO / "scripts/train.py"), *options],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    assert ended.returncode != 0
    if failure == "bad row in a worker":  # named in one line, with the worker
        line = (f"error: {tmp_path / 'c' / 'part1.jsonl'}, line 1 has no field 'text' (set data.text_column) "
                "(data.on_bad_data=skip skips such rows and counts them) (in DataLoader worker process ")
        assert line in ended.stderr and "Traceback" not in ended.stderr
    else:
        assert "out of memory (a stand-in)" in ended.stderr


def documents_of(stream: np.ndarray) -> list[str]:
    """The whole documents ([BOS] ... [EOS]) of a byte-token stream, in order."""
    starts = np.flatnonzero(stream == BOS)
    docs = []
    for begin, end in zip(starts, [*starts[1:], len(stream)], strict=True):
        body = stream[begin + 1:end]
        if len(body) and body[-1] == EOS:
            docs.append(bytes(body[:-1].astype(np.uint8)).decode())
    return docs


def test_stream_shuffles_documents_within_its_pool_every_epoch(tmp_path):
    texts = corpus(tmp_path / "c")
    cfg = stream_config(tmp_path / "c", shuffle_buffer=8)

    def epochs(cfg, seed=0):
        loader = build_loaders(cfg, 2, 0, 1, seed, "cpu", max_seq_len=64, model_vocab_size=512)[0]
        docs = documents_of(torch.cat([b.inputs.reshape(-1) for b in take(loader, 150)]).numpy())
        return docs[:len(texts)], docs[len(texts):2 * len(texts)]  # windows tile the stream

    first, second = epochs(cfg)
    assert sorted(first) == sorted(texts) and sorted(second) == sorted(texts)  # each once per epoch
    assert first != texts and second != first  # shuffled, and anew each epoch
    assert epochs(cfg) == (first, second) and epochs(cfg, seed=1)[0] != first  # seeded by the run
    # A document moves no further ahead than the pool reaches: 8 + CHUNK_ROWS documents.
    assert all(texts.index(doc) <= i + 8 + CHUNK_ROWS for i, doc in enumerate(first))
    assert epochs(stream_config(tmp_path / "c", shuffle=False))[0] == texts


@pytest.mark.slow
def test_two_process_stream_reads_every_document_once_per_epoch(tmp_path):
    texts = corpus(tmp_path / "c")
    out = tmp_path / "out"
    out.mkdir()
    replaced = ("data=", "data.num_workers", "train.steps", "train.val_every", "train.tokens_per_step")
    options = [o for o in FAST if not o.startswith(replaced)]
    # About 12 batches an epoch per rank; workers are left out (the resume test above runs them).
    options += ["data=files", f"data.path={tmp_path / 'c'}", "data.streaming=true", "data.num_workers=0",
                "data.val_fraction=0.2", "data.seq_len=32", "train.micro_batch_size=2", "train.steps=20",
                "train.val_every=10", "checkpoint.every=10", f"train.run_dir={tmp_path / 'run'}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "stream_recorder.py"), str(out), *options]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step 20/20 | val loss" in proc.stdout + proc.stderr
    training = [t for t in texts if not held_out_by_content(t, 0.2)]
    first_epochs = []
    for rank in range(2):
        inputs = np.load(out / f"rank{rank}.npy")
        docs = documents_of(inputs.reshape(-1))  # window inputs tile the reader's stream exactly
        repeat = next(i for i, d in enumerate(docs) if d in docs[:i])  # its second epoch begins
        first_epochs.append(docs[:repeat])
    everything = first_epochs[0] + first_epochs[1]
    assert sorted(everything) == sorted(training)  # every training document once, on one rank
    assert set(first_epochs[0]).isdisjoint(first_epochs[1]) and first_epochs[0] and first_epochs[1]


def write_bad_corpus(folder):
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "good one"}\nnot json\n{"text": 5}\n{"text": "good two"}\n')
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.write('{"text": "good three"}\n["a list"]\n')
    return folder


def test_bad_rows_in_a_stream_stop_the_run_naming_file_and_line(tmp_path):
    cfg = stream_config(write_bad_corpus(tmp_path / "bad"), seq_len=4)
    with pytest.raises(DataFileError, match=r"a\.jsonl, line 2 is not a JSON record .*on_bad_data=skip"):
        take(build(cfg)[0], 1)


def test_bad_rows_in_a_stream_are_skipped_and_counted(tmp_path):
    cfg = stream_config(write_bad_corpus(tmp_path / "bad"), seq_len=4, on_bad_data=OnBadData.skip,
                        shuffle=False)
    loader = build(cfg, batch_size=1)[0]
    batches = take(loader, 7)  # 28 of the 32 tokens of the good rows: within the first epoch
    count, last = loader.skipped_rows
    assert count == 3 and "b.jsonl.gz, line 2 is a JSON list" in last
    text = bytes(t for b in batches for t in b.inputs[0].tolist() if t < 256).decode()
    assert text == "good onegood twogood th"
    take(loader, 8)  # the second epoch skips them again
    assert loader.skipped_rows[0] == 6


def test_streamed_validation_skips_bad_rows_too(tmp_path):
    """data.on_bad_data=skip holds for the validation stream as for training: its bad rows are
    skipped, not fatal, and the held-out documents are read past them."""
    folder = write_bad_corpus(tmp_path / "bad")
    good = [f"held out or not {i}" for i in range(40)]
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in good))
    cfg = stream_config(folder, seq_len=4, on_bad_data=OnBadData.skip, val_fraction=0.5)
    inputs = [t for b in build(cfg, batch_size=1)[1] for t in b.inputs[0].tolist()]
    assert inputs and inputs[0] == BOS
    held_out = [t for t in ["good one", "good two", "good three", *good] if held_out_by_content(t, 0.5)]
    assert "".join(held_out).startswith(bytes(t for t in inputs if t < 256).decode())


def test_a_broken_parquet_file_is_named(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["fine " * 20]}), folder / "a.parquet")
    (folder / "b.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataFileError, match=r"b\.parquet: cannot be read as parquet"):
        take(build(stream_config(folder, seq_len=4), batch_size=1)[0], 30)


def test_token_directory_is_the_same_from_1_or_3_processes(tmp_path):
    corpus(tmp_path / "c", files=5)
    source = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), val_fraction=0.2)
    batches = []
    for processes in (1, 3):
        out = tmp_path / f"tokens{processes}"
        results = tokenize_to_dir(source, out, shards=4, processes=processes)
        assert sorted(r.index for r in results) == [0, 1, 2, 3]
        cfg = DataConfig(source=DataSource.tokens, path=str(out), seq_len=16, keep_document_boundaries=True,
                         num_workers=0)
        train_loader, val_loader = build(cfg, batch_size=3)
        batches.append((take(train_loader, 8), list(val_loader)))
    assert same(batches[0][0], batches[1][0]) and same(batches[0][1], batches[1][1])


@pytest.mark.parametrize("processes", [1, 2])
def test_tokenizing_workers_are_single_threaded(tmp_path, monkeypatch, processes):
    """Each worker loads its tokenizer with the Rayon pool off, so N workers use N cores (and the
    1-process rate is one core's); the caller's environment is left as it was."""
    corpus(tmp_path / "c")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    seen = tmp_path / "seen"
    seen.mkdir()

    def recording_load(spec):  # the forked workers inherit this patch
        names = ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")
        (seen / str(os.getpid())).write_text(" ".join(str(os.environ.get(n)) for n in names))
        return load_tokenizer(spec)

    monkeypatch.setattr(pretokenize, "load_tokenizer", recording_load)
    source = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), val_fraction=0.0)
    tokenize_to_dir(source, tmp_path / "tokens", shards=4, processes=processes)
    # The parent loads it too, for what the shards are made from, and tokenizes nothing.
    workers = [p for p in seen.iterdir() if p.name != str(os.getpid())]
    assert {p.read_text() for p in workers} == {"false 1"} and len(workers) == processes
    assert "TOKENIZERS_PARALLELISM" not in os.environ and "RAYON_NUM_THREADS" not in os.environ


def test_machines_split_the_shards_and_an_incomplete_directory_is_named(tmp_path):
    corpus(tmp_path / "c")
    source = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), val_fraction=0.0)
    out = tmp_path / "tokens"
    written = tokenize_to_dir(source, out, shards=4, processes=1, machine=1, machines=2)
    assert [r.index for r in written] == [1, 3]
    cfg = DataConfig(source=DataSource.tokens, path=str(out), seq_len=16, val_fraction=0.0)
    with pytest.raises(ValueError, match=r"incomplete: 2 of 4 shards missing \(0, 2\)"):
        build(cfg)
    written = tokenize_to_dir(source, out, shards=4, processes=1, machine=0, machines=2)
    assert [r.index for r in written] == [0, 2]
    assert tokenize_to_dir(source, out, shards=4, processes=1) == []  # finished shards are skipped
    assert len(build(cfg)[0]) > 0
    # Another tokenization is refused before anything is written or skipped.
    word_tokenizer(["<s>", "</s>"])[0].save(str(tmp_path / "tokenizer.json"))
    others = {"tokenizer: 'byte-v1' there, 'hf-": dataclasses.replace(source, tokenizer=str(tmp_path)),
              "val_fraction: 0.0 there, 0.5 here": dataclasses.replace(source, val_fraction=0.5),
              "source: other files, or the same files changed since": dataclasses.replace(
                  source, path=str(tmp_path / "c" / "part0.jsonl"))}
    for differs, other in others.items():
        with pytest.raises(ValueError, match=rf"^{out} holds shards of another tokenization \(shard-00000-of-"
                                             rf"00004.json: {re.escape(differs)}"):
            tokenize_to_dir(other, out, shards=4, processes=1)
    with pytest.raises(ValueError, match=r"\(shard-00000-of-00004.json: shards: 4 there, 2 here\)"):
        tokenize_to_dir(source, out, shards=2, processes=1)
    markers = sorted(p.name for p in out.glob("shard-*.json"))
    assert markers == [f"shard-{shard_name(i, 4)}.json" for i in range(4)]
    with pytest.raises(ValueError, match="another tokenizer"):
        build(DataConfig(source=DataSource.tokens, path=str(out), tokenizer=str(tmp_path), seq_len=16))
    # Shards of a version that encoded a special token written in a text as its id are not joined.
    first = out / f"shard-{shard_name(0, 4)}.json"
    marker = json.loads(first.read_text())
    del marker["spec"]["text_encoding"]
    first.write_text(json.dumps(marker))
    with pytest.raises(ValueError, match=r"text_encoding: None there, 'special tokens as text' here"):
        tokenize_to_dir(source, out, shards=4, processes=1)


@pytest.mark.parametrize("sample_by", ["document", "paragraph", "line"])
def test_a_stream_cuts_text_files_into_the_documents_the_token_cache_does(tmp_path, sample_by):
    """Windows line ends, a lone "\\r" and a form feed: the stream (and so tokenize_corpus.py) read
    them as bytes, so a CRLF file was one document by paragraph, kept its "\\r\\n" by document and
    ended lines at the form feed, while the cache (datasets' text builder) reads universal newlines."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_bytes(b"one\r\nstill one\r\n\r\ntwo\rthree\x0cfour\r\n\r\nfive\n")
    cfg = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), text_sample_by=sample_by,
                     cache_dir=str(tmp_path / "cache"))
    source = data_sources(cfg)[0]
    batches, _ = source.read()
    cached = [t for batch in batches for t in batch if t]
    assert len(cached) == {"document": 1, "paragraph": 3, "line": 5}[sample_by]
    assert [row["text"] for row in source.stream() if row["text"]] == cached


def test_a_stream_saved_by_one_process_starts_again_on_two_with_a_warning(tmp_path, monkeypatch):
    """README: another number of processes starts the stream again, with a warning. From one process
    the state (the same on every rank, as there is one) was loaded as is, and the stream refused it:
    the run stopped with 'train.run_dir holds another experiment: ... saved with world_size=1'."""
    corpus(tmp_path / "c")
    one = build(stream_config(tmp_path / "c"))[0]
    take(one, 3)
    step_dir = tmp_path / "step_3"
    step_dir.mkdir()
    write_json(step_dir / "rank_00000.json", {"loaders": {"train": one.state_dict()}, "rng": None})
    monkeypatch.setattr(checkpoint, "_world_size", lambda: 2)
    monkeypatch.setattr(checkpoint, "process_rank", lambda: 1)
    two, logs = build(stream_config(tmp_path / "c"), rank=1, world_size=2)[0], []
    checkpoint._load_rank_state(step_dir, 1, {"train": two}, logs.append)
    assert logs == ["warning: the train data state is where each of 1 processes stood in its own part of "
                    "the stream and cannot move to 2 processes; that loader starts from its beginning"]
    assert same(take(two, 3), take(build(stream_config(tmp_path / "c"), rank=1, world_size=2)[0], 3))


def test_a_json_array_file_streams_the_records_the_token_cache_reads(tmp_path):
    """A .json file of one array (data=files reads it): the stream, and so tokenize_corpus.py, read it
    line by line, so every line was a bad row ('line 1 is not a JSON record (Expecting value ...)')."""
    texts = [f"doc {i} " + "words " * (i % 5 + 1) for i in range(40)]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.json").write_text(json.dumps([{"text": t, "id": i} for i, t in enumerate(texts)],
                                                      indent=2))
    cfg = stream_config(tmp_path / "c", cache_dir=str(tmp_path / "cache"))
    source = data_sources(cfg)[0]
    batches, _ = source.read()
    assert [t for batch in batches for t in batch] == texts
    assert [row["text"] for row in source.stream()] == texts
    (tmp_path / "c" / "a.json").write_text(json.dumps([{"text": "one"}, {"body": "two"}]))
    rows = list(data_sources(cfg)[0].stream())
    assert rows[1] == {"text": None, "error": f"{tmp_path / 'c' / 'a.json'}, record 2 has no field 'text' "
                                              "(set data.text_column)"}
