"""Where documents come from: the embedded corpus, local files, or a Hub dataset, all via `datasets`.

A `Source` is described before anything is read (`identity`, which keys the token cache, so a
cached run never touches the files or the network) and opened only when it must be tokenized.

`Source.stream()` is the same documents as a sharded `datasets.IterableDataset` (one shard per local
file, or the Hub dataset's own shards) of rows {"text", "error"}: a row that cannot be a document
(bad JSON, a missing or non-string text field, an unreadable file) carries the file and line or row
in `error` instead of stopping the stream, so the reader decides whether to skip it or stop.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

EMBEDDED_PATH = Path(__file__).parent / "corpus" / "python_docs.jsonl.gz"
# The shipped bytes, checked on every read: the corpus must be identical on every machine.
EMBEDDED_SHA256 = "10ab05063e6f8db530ec151eefdb1f6b79a6b5f2a3f717ad866cc361899e3e3d"

_COMPRESSION_SUFFIXES = {".gz", ".bz2", ".xz", ".zst", ".lz4"}
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
             ".parquet": "parquet"}
_SAMPLE_BY = ("document", "paragraph", "line")
_STREAM_FEATURES = datasets.Features({"text": datasets.Value("string"), "error": datasets.Value("string")})


class DataFileError(ValueError):
    """A data file that cannot be read as its format says; the message names the file, the line or
    row where known, and what is wrong (the train script prints it as one line)."""


def load_dataset(**load_args: Any) -> datasets.Dataset | datasets.IterableDataset:
    """`datasets.load_dataset`, with a Hub dataset it cannot reach as a DataFileError (one line)."""
    try:
        return datasets.load_dataset(**load_args)
    except ConnectionError as exc:  # no network, or offline and not in the cache
        raise DataFileError(f"data.path={load_args['path']}: {exc}; check the name and the network, "
                            "or set HF_DATASETS_OFFLINE=1 to read a copy in the datasets cache") from None


@dataclass(frozen=True)
class Source:
    """Documents of one dataset, read through `datasets.load_dataset(**load_args)`."""

    kind: str  # embedded | files | hub
    location: str  # what the user named, for messages
    text_column: str
    identity: dict[str, Any]
    load_args: dict[str, Any] = field(default_factory=dict)
    max_documents: int | None = None

    def read(self, batch_size: int = 256) -> tuple[Iterator[list[str | None]], int | None]:
        """The text column in batches, in the source's order, and the number of documents when the
        dataset knows it (streams do not)."""
        if self.kind == "embedded":
            digest = hashlib.sha256(EMBEDDED_PATH.read_bytes()).hexdigest()
            if digest != EMBEDDED_SHA256:
                raise ValueError(f"embedded corpus {EMBEDDED_PATH} is altered: sha256 {digest}, "
                                 f"expected {EMBEDDED_SHA256}")
        try:
            with _builder_errors_unlogged(self.load_args["path"]):
                ds = load_dataset(**self.load_args)
        except DataFileError:
            raise
        # A file broken before generation starts (a bad gzip header or a truncated stream, met when
        # the builder infers the features) raises the reader's own error, not datasets' wrapper.
        except (datasets.exceptions.DatasetGenerationError, OSError, EOFError, pa.ArrowException) as exc:
            raise self._unreadable(exc) from exc
        # Local files without a single record: the json builder's feature inference runs out of rows
        # (a bare StopIteration), and a split of blank lines has "no data" (datasets' ValueError).
        except (StopIteration, ValueError) as exc:
            if self.kind != "files":
                raise
            raise self._unreadable(exc) from None
        columns = ds.column_names  # None for a stream whose features are not declared
        if columns is not None:
            if self.text_column not in columns:
                raise self._missing_column(columns)
            ds = ds.select_columns([self.text_column])  # do not decode the other columns
        if self.max_documents is not None:
            ds = ds.take(self.max_documents)
        total = len(ds) if isinstance(ds, datasets.Dataset) else None
        return self._batches(ds, batch_size), total

    def stream(self) -> datasets.IterableDataset:
        """The documents as a sharded stream of {"text", "error"} rows (module docstring), in the
        source's order; `datasets.distributed.split_dataset_by_node` splits it by shard."""
        if self.kind == "files":
            files = self.load_args["data_files"]
            ds = datasets.IterableDataset.from_generator(
                _stream_file_rows, features=_STREAM_FEATURES,
                gen_kwargs={"files": files, "builder": self.load_args["path"],
                            "text_column": self.text_column,
                            "sample_by": self.load_args.get("sample_by", "document")})
        else:
            ds = load_dataset(**{**self.load_args, "streaming": True})
            if ds.column_names is not None and self.text_column not in ds.column_names:
                raise self._missing_column(ds.column_names)
            ds = ds.map(_checked_row, fn_kwargs={"text_column": self.text_column, "location": self.location},
                        remove_columns=ds.column_names, features=_STREAM_FEATURES)
        return ds if self.max_documents is None else ds.take(self.max_documents)

    def _batches(self, ds: datasets.Dataset | datasets.IterableDataset,
                 batch_size: int) -> Iterator[list[str | None]]:
        row = 0
        for batch in ds.iter(batch_size=batch_size):
            if self.text_column not in batch:
                raise self._missing_column(list(batch))
            texts = batch[self.text_column]
            for i, text in enumerate(texts):
                if text is not None and not isinstance(text, str):
                    raise DataFileError(f"{self.location}, row {row + i + 1}: the text column "
                                        f"{self.text_column!r} holds {type(text).__name__} {text!r:.40}, "
                                        "not a string")
            row += len(texts)
            yield texts

    def _unreadable(self, exc: Exception) -> DataFileError:
        """The error for a dataset that `datasets` failed to build: the first bad file and line when
        a local file can be pinned down, else the innermost cause."""
        files = self.load_args.get("data_files") or []
        files = [files] if isinstance(files, str) else files
        for file in files:
            problem = _file_problem(file, self.load_args["path"])
            if problem is not None:
                return DataFileError(f"{file}: {problem}")
        if files and all(_holds_no_records(file, self.load_args["path"]) for file in files):
            which = "its file is" if len(files) == 1 else f"its {len(files)} files are"
            return DataFileError(f"data path {self.location!r} has no documents: {which} empty")
        cause: BaseException = exc
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        return DataFileError(f"cannot read {self.location}: {type(cause).__name__}: {cause}")

    def _missing_column(self, columns: list[str]) -> ValueError:
        return ValueError(f"text column {self.text_column!r} is not in {self.location} "
                          f"(columns: {', '.join(columns)}); set data.text_column")


class _DropErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


@contextlib.contextmanager
def _builder_errors_unlogged(builder: str) -> Iterator[None]:
    """A `datasets` builder (json, parquet, ...) logs a file it cannot read at ERROR level before it
    raises; the DataFileError made of that names the file and line in one line, so its log record
    would only print the same problem twice more (datasets' handler and the root one)."""
    logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    drop = _DropErrors()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def embedded_source(max_documents: int | None, cache_dir: str | None) -> Source:
    """The shipped corpus of CPython documentation (corpus/README.md), one JSON record per document."""
    return Source(
        kind="embedded", location=str(EMBEDDED_PATH), text_column="text",
        identity={"embedded": EMBEDDED_SHA256},
        load_args={"path": "json", "data_files": str(EMBEDDED_PATH), "split": "train",
                   "cache_dir": cache_dir},
        max_documents=max_documents,
    )


def files_source(path: str, text_column: str, sample_by: str, max_documents: int | None,
                 cache_dir: str | None) -> Source:
    """A file, a folder (searched recursively) or a glob of .txt/.md, .json/.jsonl or .parquet files,
    optionally compressed. Plain text becomes one row per file, paragraph or line (`sample_by`)."""
    files = resolve_files(path)
    builders = {_BUILDERS.get(_format_suffix(f)) for f in files}
    if None in builders:
        unknown = sorted({f.name for f in files if _format_suffix(f) not in _BUILDERS})
        raise ValueError(f"data path {path!r} has files of unknown format: {', '.join(unknown[:5])} "
                         f"(supported: {', '.join(sorted(_BUILDERS))}, optionally compressed)")
    if len(builders) > 1:
        raise ValueError(f"data path {path!r} mixes formats ({', '.join(sorted(builders))}); "
                         "point it at files of one format")
    builder = builders.pop()
    load_args: dict[str, Any] = {"path": builder, "data_files": [str(f) for f in files], "split": "train",
                                 "cache_dir": cache_dir}
    if builder == "text":
        if sample_by not in _SAMPLE_BY:
            raise ValueError(f"data.text_sample_by={sample_by!r} is not one of {', '.join(_SAMPLE_BY)}")
        load_args["sample_by"] = sample_by
        # The text builder names its only column "text".
        text_column = "text"
    # Size and modification time stand in for content, so an edited file is tokenized again.
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    identity = {"files": stats, "builder": builder, "sample_by": sample_by if builder == "text" else None}
    return Source("files", path, text_column, identity, load_args, max_documents)


def hub_source(name: str, config_name: str | None, split: str, streaming: bool, text_column: str,
               max_documents: int | None, cache_dir: str | None) -> Source:
    """A dataset on the Hugging Face Hub. A stream is read once, into the token cache."""
    load_args = {"path": name, "name": config_name, "split": split, "streaming": streaming,
                 "cache_dir": cache_dir}
    identity = {"hub": name, "name": config_name, "split": split}
    return Source("hub", f"{name}[{split}]", text_column, identity, load_args, max_documents)


# The rule by which data.val_fraction holds documents out, recorded in loader states. 1: the stored
# cache and SFT held out by document index; 2: every path holds out by content (`held_out_by_content`).
SPLIT_VERSION = 2


def held_out_by_content(text: str, fraction: float) -> bool:
    """Whether a document belongs to the held-out split (data.val_fraction), on every path: the
    token cache, token directories, streaming and SFT (which passes its conversation's canonical
    text). Decided by a hash of the text, so it needs neither the document's position (unknown to one
    rank's part of a stream) nor the number of ranks, and copies of a document all fall on the same
    side: the same corpus and fraction give the same validation documents whichever way it is read."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def stream_texts(batch: dict[str, list[str | None]], skip_bad: bool) -> tuple[list[str], list[str]]:
    """(the non-empty documents, the error messages of bad rows) of a batch of stream rows; raises
    the first bad row's DataFileError unless `skip_bad`."""
    errors = [e for e in batch["error"] if e is not None]
    if errors and not skip_bad:
        raise DataFileError(f"{errors[0]} (data.on_bad_data=skip skips such rows and counts them)")
    return [t for t in batch["text"] if t], errors


def _checked_row(row: dict[str, Any], text_column: str, location: str) -> dict[str, str | None]:
    text = row.get(text_column)
    if text is None or isinstance(text, str):
        return {"text": text, "error": None}
    return {"text": None, "error": f"{location}: the text column {text_column!r} holds "
                                   f"{type(text).__name__} {text!r:.40}, not a string"}


def _stream_file_rows(files: list[str], builder: str, text_column: str,
                      sample_by: str) -> Iterator[dict[str, str | None]]:
    """The rows of local files in order; a bad line or file becomes an error row naming it."""
    for file in files:
        try:
            if builder == "json":
                yield from _json_rows(file, text_column)
            elif builder == "parquet":
                yield from _parquet_rows(file, text_column)
            else:
                yield from _text_rows(file, sample_by)
        except Exception as exc:  # a truncated or corrupt file: every reader error says how
            yield {"text": None,
                   "error": f"{file}: cannot be read as {builder} ({type(exc).__name__}: {exc})"}


def _json_rows(file: str, text_column: str) -> Iterator[dict[str, str | None]]:
    with fsspec.open(file, "rb", compression="infer") as f:
        if f.read(1 << 12).lstrip().startswith(b"["):  # one JSON array of records, as `datasets` reads it
            yield from _json_array_rows(file, text_column)
            return
    with fsspec.open(file, "rb", compression="infer") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                record = json.loads(line)
            except UnicodeDecodeError as exc:
                row = _error_row(file, f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start})")
            except json.JSONDecodeError as exc:
                row = _error_row(file, f"line {number} is not a JSON record ({exc.msg} at column "
                                       f"{exc.colno})")
            else:
                row = _record_row(file, f"line {number}", record, text_column)
            yield row


def _json_array_rows(file: str, text_column: str) -> Iterator[dict[str, str | None]]:
    """The records of a .json file that is one array (over any number of lines)."""
    with fsspec.open(file, "rb", compression="infer") as f:
        data = f.read()
    try:
        records = json.loads(data)
    except UnicodeDecodeError as exc:
        yield _error_row(file, f"is not UTF-8 text ({exc.reason} at byte {exc.start})")
        return
    except json.JSONDecodeError as exc:
        yield _error_row(file, f"is not a JSON array ({exc.msg} at line {exc.lineno}, column {exc.colno})")
        return
    for number, record in enumerate(records, start=1):
        yield _record_row(file, f"record {number}", record, text_column)


def _error_row(file: str, error: str) -> dict[str, str | None]:
    return {"text": None, "error": f"{file}, {error}"}


def _record_row(file: str, where: str, record: Any, text_column: str) -> dict[str, str | None]:
    """The row of one JSON record (`where` in `file`): its text, or an error row saying what is wrong."""
    if not isinstance(record, dict):
        return _error_row(file, f"{where} is a JSON {type(record).__name__}, not a record (object)")
    if text_column not in record:
        return _error_row(file, f"{where} has no field {text_column!r} (set data.text_column)")
    value = record[text_column]
    if value is not None and not isinstance(value, str):
        return _error_row(file, f"{where}: {text_column!r} holds {type(value).__name__} {value!r:.40}, "
                                "not a string")
    return {"text": value, "error": None}


def _parquet_rows(file: str, text_column: str) -> Iterator[dict[str, str | None]]:
    with fsspec.open(file, "rb", compression="infer") as f:
        parquet = pq.ParquetFile(f)
        names = parquet.schema_arrow.names
        if text_column not in names:
            yield {"text": None, "error": f"{file}: no column {text_column!r} (columns: {', '.join(names)}); "
                                         "set data.text_column"}
            return
        kind = parquet.schema_arrow.field(text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            yield {"text": None, "error": f"{file}: column {text_column!r} is {kind}, not text"}
            return
        for batch in parquet.iter_batches(columns=[text_column]):
            for text in batch.column(0).to_pylist():
                yield {"text": text, "error": None}


def _text_rows(file: str, sample_by: str) -> Iterator[dict[str, str | None]]:
    with fsspec.open(file, "rb", compression="infer") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        yield {"text": None, "error": f"{file}, line {line} is not UTF-8 text ({exc.reason} at byte "
                                     f"{exc.start}); is it a binary file?"}
        return
    # As datasets' text builder reads them (the token cache's path): "\r\n" and "\r" read as "\n" (a
    # text-mode file's universal newlines), and lines end at "\n" only (str.splitlines would also
    # end them at form feeds, "\x1c".."\x1e", "\x85", "\u2028" ...).
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    pieces = {"document": [text], "paragraph": text.split("\n\n"), "line": text.split("\n")}[sample_by]
    for piece in pieces:
        yield {"text": piece, "error": None}


def _file_problem(file: str, builder: str) -> str | None:
    """What makes `file` unreadable by the `builder` (text | json | parquet), or None if nothing
    is found. Compressed files are read through fsspec, as `datasets` reads them."""
    try:
        if builder == "parquet":
            with fsspec.open(file, "rb", compression="infer") as f:
                pq.read_table(f)
            return None
        with fsspec.open(file, "rb", compression="infer") as f:
            data = f.read()
    except Exception as exc:  # the file itself is broken: any reader error says how
        return f"cannot be read as {builder} ({type(exc).__name__}: {exc})"
    first_error = None
    for number, line in enumerate(data.splitlines(), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"line {number} is not UTF-8 text ({exc.reason} at byte {exc.start}); is it a binary file?"
        if builder != "json" or not text.strip() or first_error is not None:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            first_error = f"line {number} is not a JSON record ({exc.msg} at column {exc.colno})"
            continue
        if not isinstance(record, dict):
            first_error = f"line {number} is a JSON {type(record).__name__}, not a record (object)"
    if first_error is None:
        return None
    try:  # a JSON document over many lines (one array or object) is valid too
        json.loads(data)
        return None
    except ValueError:
        return first_error


def _holds_no_records(file: str, builder: str) -> bool:
    """Whether `file` is empty: no rows (parquet), or nothing but whitespace (text, json)."""
    try:
        with fsspec.open(file, "rb", compression="infer") as f:
            if builder == "parquet":
                return pq.ParquetFile(f).metadata.num_rows == 0
            return not f.read().strip()
    except Exception:  # unreadable is not empty: _file_problem names what is wrong
        return False


def _format_suffix(file: Path) -> str:
    suffixes = [s.lower() for s in file.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION_SUFFIXES:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def resolve_files(path: str) -> list[Path]:
    if glob.has_magic(path):
        files = sorted(Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file())
        if not files:
            raise FileNotFoundError(f"data path {path!r} matches no files")
        return files
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data path {path!r} does not exist")
    if root.is_file():
        return [root]
    files = sorted(p for p in root.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise ValueError(f"data path {path!r} is an empty folder")
    return files
