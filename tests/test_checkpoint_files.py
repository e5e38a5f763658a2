"""The files of a training checkpoint alone: sizes and checksums recorded while writing, and DCP's
save and load in one process."""

import hashlib
import warnings

import torch

from codatrain.train.checkpoint_files import HashingFileSystem, dcp_load, dcp_save, file_checksum


def test_a_file_written_in_pieces_records_the_size_and_checksum_of_all_its_bytes(tmp_path):
    file_system = HashingFileSystem()
    with file_system.create_stream(tmp_path / "part.bin", "wb") as stream:
        stream.write(b"abc")
        stream.write(memoryview(b"defg"))
    data = (tmp_path / "part.bin").read_bytes()
    assert data == b"abcdefg"
    assert file_system.written == {"part.bin": {"bytes": 7, "blake2b": hashlib.blake2b(data).hexdigest()}}
    assert file_checksum(tmp_path / "part.bin") == hashlib.blake2b(data).hexdigest()


def test_one_process_saves_and_loads_without_warnings_and_records_every_file(tmp_path):
    tensors = {"model.w": torch.arange(12.0).reshape(3, 4), "model.b": torch.tensor([1, 2])}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = dcp_save(tensors, tmp_path)
        loaded = {name: torch.zeros_like(t) for name, t in tensors.items()}
        dcp_load(loaded, tmp_path, {"files": sorted(written)})
    # DCP warns on every call without a process group; a single-process run is the intended case.
    assert [str(w.message) for w in caught] == []
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)
    assert any(name.endswith(".safetensors") for name in written)
    for name, record in written.items():
        path = tmp_path / name
        assert record == {"bytes": path.stat().st_size, "blake2b": file_checksum(path)}
