"""The files of a training checkpoint: DCP's safetensors shards and JSON, each recorded with its size
and checksum while it is written, and read back only as a manifest lists them (checkpoint.py)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

CHECKSUM = "blake2b"


class HashingStream:
    """A file being written, hashing its bytes on their way to disk."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.hash, self.size = raw, hashlib.blake2b(), 0

    def write(self, data: Any) -> int:
        # Hash on another thread while this one writes (both release the GIL): where a core is
        # free, the checksum overlaps the write instead of adding to it.
        hashing = threading.Thread(target=self.hash.update, args=(data,))
        hashing.start()
        try:
            written = self.raw.write(data)
        finally:
            hashing.join()
        self.size += memoryview(data).nbytes
        return written

    def record(self) -> dict[str, Any]:
        return {"bytes": self.size, CHECKSUM: self.hash.hexdigest()}

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close: the file's own
        return getattr(self.raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording the size and checksum of every file it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, dict[str, Any]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(raw)
            yield stream
        self.written[Path(path).name] = stream.record()


class ListedFileSystem(FileSystem):
    """DCP's local file system, showing a reader only the files a manifest lists."""

    def __init__(self, files: list[str]) -> None:
        super().__init__()
        self.files = files

    def ls(self, path: str | os.PathLike) -> list[str]:
        return [str(Path(path) / name) for name in self.files]


def dcp_save(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, dict[str, Any]]:
    """Write this rank's tensors; returns the size and checksum of each file it wrote."""
    # Each rank writes its own safetensors file, with its shards' offsets in the header.
    writer = dcp.HuggingFaceStorageWriter(str(path), save_distributed=True)
    writer.fs = file_system = HashingFileSystem()
    with warnings.catch_warnings():
        # DCP warns on every call without a process group, the intended single-process case.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())
    return file_system.written


def checkpoint_reader(path: Path, manifest: Mapping[str, Any]) -> dcp.HuggingFaceStorageReader:
    """DCP's reader of the tensor files that `manifest` (from inspect_checkpoint) lists, and no
    others: a stray .safetensors file in the directory (an HF export, say) is not read."""
    reader = dcp.HuggingFaceStorageReader(str(path))
    reader.fs = ListedFileSystem(sorted(n for n in manifest["files"] if n.endswith(".safetensors")))
    return reader


def dcp_load(tensors: dict[str, torch.Tensor], path: Path, manifest: Mapping[str, Any]) -> None:
    """Fill `tensors` in place (each rank its shards) from the checkpoint at `path`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=checkpoint_reader(path, manifest), no_dist=not dist.is_initialized())


def write_json(path: Path, obj: Any) -> dict[str, Any]:
    """Write `obj` as JSON; returns the file's size and checksum."""
    data = json.dumps(obj).encode()
    # fsync: the rename that publishes a checkpoint must not overtake its contents on a crash.
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), CHECKSUM: hashlib.blake2b(data).hexdigest()}


def copy_file(source: Path, path: Path) -> dict[str, Any]:
    """Copy `source` to `path`; returns the copy's size and checksum."""
    data = source.read_bytes()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), CHECKSUM: hashlib.blake2b(data).hexdigest()}


def file_checksum(path: Path) -> str:
    digest = hashlib.blake2b()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
