"""Bad data files give one-line errors that name the file, the line or row, and what is wrong."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codatrain.config import DataConfig, load_config
from codatrain.data import prepare_streams
from codatrain.data.sources import DataFileError
from codatrain.train.trainer import train

# Bytes that are not UTF-8 (a lone continuation byte, then an invalid lead byte), as in an
# executable or an image.
BINARY = b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)) * 4


def streams_of(tmp_path, path):
    return prepare_streams(DataConfig(source="files", path=str(path), val_fraction=0.0,
                                      cache_dir=str(tmp_path / "cache")))


def records(*texts):
    return "".join(json.dumps({"text": t}) + "\n" for t in texts)


def test_binary_file_named_txt_names_the_file_and_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("fine text\n")
    (tmp_path / "docs" / "b.txt").write_bytes(b"a first line\n" + BINARY)
    with pytest.raises(DataFileError, match=r"b\.txt: line 2 is not UTF-8 text"):
        streams_of(tmp_path, tmp_path / "docs")


def test_jsonl_with_garbage_appended_names_the_file_and_line(tmp_path, capfd, caplog):
    path = tmp_path / "d.jsonl"
    path.write_text(records("one", "two", "three") + "garbage {{{\n")
    with pytest.raises(DataFileError, match=r"d\.jsonl: line 4 is not a JSON record"):
        streams_of(tmp_path, path)
    # The error is the one line: datasets' own ERROR record of the file is not printed before it.
    assert "Failed to load JSON" not in capfd.readouterr().err + caplog.text


def test_compressed_jsonl_with_a_record_that_is_not_an_object(tmp_path):
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress((records("one") + "[1, 2]\n" + records("three")).encode()))
    with pytest.raises(DataFileError, match=r"d\.jsonl\.gz: line 2 is a JSON list, not a record"):
        streams_of(tmp_path, path)


@pytest.mark.parametrize("name, content, problem", [
    ("b.jsonl.gz", b"not gzip at all\n", r"cannot be read as json \(BadGzipFile: Not a gzipped file"),
    ("b.jsonl.gz", gzip.compress(records(*[f"hello {i}" for i in range(50)]).encode())[:70],
     r"cannot be read as json \(EOFError: Compressed file ended before the end-of-stream marker"),
    ("b.parquet", b"PAR1xx", r"cannot be read as parquet \(ArrowInvalid: "),
], ids=["gzip", "truncated-gzip", "parquet"])
def test_a_file_broken_before_its_first_record_is_named(tmp_path, name, content, problem):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataFileError, match=rf"^{tmp_path / name}: {problem}"):
        streams_of(tmp_path, tmp_path / name)


def test_pretty_printed_json_document_is_still_read(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": "one"}, {"text": "two"}], indent=2))
    assert streams_of(tmp_path, path).train.num_documents == 2


@pytest.mark.parametrize("values", [["hello", 42], [7, 42]], ids=["mixed", "all-numbers"])
def test_text_field_that_is_a_number_names_the_file_and_row(tmp_path, values):
    path = tmp_path / "d.jsonl"
    path.write_text(records(*values))
    row = 1 + [isinstance(v, str) for v in values].index(False)
    with pytest.raises(DataFileError, match=rf"d\.jsonl, row {row}: the text column 'text' holds int"):
        streams_of(tmp_path, path)


def test_training_stops_with_the_error_the_train_script_prints_as_one_line(tmp_path):
    """scripts/train.py turns a ValueError into `error: <message>`; the data error must be one."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(BINARY)
    cfg = load_config(["data.source=files", f"data.path={bad}", f"data.cache_dir={tmp_path / 'cache'}",
                       f"train.run_dir={tmp_path / 'run'}", "train.steps=1", "train.progress=false"])
    with pytest.raises(ValueError) as caught:
        train(cfg)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(f"{bad}: line 1 is not UTF-8 text")


@pytest.mark.parametrize("name, content", [
    ("d.jsonl", b""),
    ("d.jsonl", b"\n\n"),
    ("d.json", b""),
    ("d.parquet", None),
], ids=["empty-jsonl", "blank-jsonl", "empty-json", "parquet-without-rows"])
def test_a_source_whose_files_are_empty_says_so(tmp_path, name, content):
    """The json builder ran out of rows with a bare StopIteration (a traceback, no message), a file of
    blank lines gave datasets' 'Instruction "train" corresponds to no data!', a parquet file of no
    rows 'ArrowInvalid: BatchSize must be greater than 0'."""
    path = tmp_path / "docs" / name
    path.parent.mkdir()
    if content is None:
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path.write_bytes(content)
    expected = rf"^data path '{path.parent}' has no documents: its file is empty$"
    with pytest.raises(DataFileError, match=expected):
        streams_of(tmp_path, path.parent)
