"""Tokenizers: a byte-level default and any Hugging Face fast tokenizer from a local path.

Both expose the same small surface: `vocab_size`, `bos_id` / `eos_id` (the document delimiters
packing inserts), `encode_batch` and a `fingerprint` that keys the token cache, so a changed
tokenizer never reuses tokens made by another.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Protocol

import numpy as np

from codatrain.model.hf import hub_id_hint

# Names under which tokenizer.json files commonly carry their delimiters, most specific first.
# Only used for a bare tokenizer.json; a folder's tokenizer_config.json names them explicitly.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|bos|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|eos|>")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    fingerprint: str

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS = 256 and EOS = 257."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257
    fingerprint = "byte-v1"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """The text of the byte ids; BOS, EOS and ids beyond the bytes are left out."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` fast tokenizer, from a tokenizer.json file or a saved Hugging Face folder."""

    def __init__(self, path: str | Path, setting: str = "data.tokenizer") -> None:
        """`setting` names where the path came from, in errors."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer {str(path)!r} ({setting}) does not exist{hub_id_hint(path)}")
        if path.is_dir() and (path / "tokenizer_config.json").is_file():
            self._backend, self.bos_id, eos_id = _from_folder(path, setting)
        else:
            file = path / "tokenizer.json" if path.is_dir() else path
            if not file.is_file():
                raise FileNotFoundError(f"tokenizer {str(path)!r} ({setting}) has neither tokenizer.json "
                                        "nor tokenizer_config.json")
            self._backend, self.bos_id, eos_id = _from_file(file)
        if eos_id is None:
            raise ValueError(
                f"tokenizer {str(path)!r} has no end-of-text token (looked for {', '.join(_EOS_NAMES)}); "
                "save it as a folder whose tokenizer_config.json sets eos_token"
            )
        self.eos_id = eos_id
        # Packing adds BOS/EOS itself and documents must never be cut short or padded.
        self._backend.no_truncation()
        self._backend.no_padding()
        # transformers 5 loads a Qwen2 folder whose tokenizer_config.json has no tokenizer.json beside
        # it as a tokenizer of its special tokens alone, which turns every text into nothing: training
        # would see only BOS and EOS.
        specials = {token.content for token in self._backend.get_added_tokens_decoder().values()}
        if not set(self._backend.get_vocab(with_added_tokens=False)) - specials:
            raise ValueError(
                f"tokenizer {str(path)!r} ({setting}) turns text into no tokens: it has no vocabulary "
                "beyond its special tokens (a tokenizer_config.json without its tokenizer.json?)"
            )
        # A document's text is text: one that writes a special token ("<|end_of_text|>" in a page
        # about tokenizers) is encoded as those characters, not as the token, which would put an EOS
        # or BOS inside the document (as Llama 3's and torchtitan's tiktoken encode with no
        # allowed_special). Only packing's delimiters are special ids.
        self._backend.encode_special_tokens = True
        self.vocab_size = max(self._backend.get_vocab(with_added_tokens=True).values()) + 1
        digest = hashlib.sha256(self._backend.to_str().encode()).hexdigest()[:16]
        self.fingerprint = f"hf-{digest}-bos{self.bos_id}-eos{self.eos_id}"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._backend.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        """The text of one token id, as the vocabulary writes it."""
        return self._backend.id_to_token(token_id)


def _from_file(file: Path) -> tuple[object, int | None, int | None]:
    try:
        from tokenizers import Tokenizer as Backend
    except ImportError as e:
        raise ImportError("a tokenizer.json needs the `tokenizers` package (pip install tokenizers)") from e
    backend = Backend.from_file(str(file))
    bos = next((i for i in map(backend.token_to_id, _BOS_NAMES) if i is not None), None)
    eos = next((i for i in map(backend.token_to_id, _EOS_NAMES) if i is not None), None)
    # GPT-2 style tokenizers have one delimiter; it then separates documents on its own.
    return backend, (bos if bos != eos else None), eos


def _from_folder(folder: Path, setting: str) -> tuple[object, int | None, int | None]:
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError("a tokenizer folder needs `transformers` (pip install transformers)") from e
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as error:  # e.g. a tokenizer_config.json whose tokenizer.json is missing
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"tokenizer {str(folder)!r} ({setting}) cannot be loaded by transformers "
                         f"({reason}); a folder needs tokenizer.json beside tokenizer_config.json") from None
    if not tok.is_fast:
        raise ValueError(f"tokenizer {str(folder)!r} has no fast (tokenizer.json) version")
    bos, eos = tok.bos_token_id, tok.eos_token_id
    return tok.backend_tokenizer, (bos if bos != eos else None), eos


def check_vocab(vocab_size: int, model_vocab_size: int, named: str) -> None:
    """ValueError when the tokenizer `named` (e.g. "data.tokenizer=byte") has ids past the model's
    embedding: training would index past it, generation decode noise."""
    if vocab_size > model_vocab_size:
        raise ValueError(f"{named} has {vocab_size} token ids, more than model.vocab_size="
                         f"{model_vocab_size}; use the tokenizer the model was trained with")


def load_tokenizer(spec: str | None, setting: str = "data.tokenizer") -> Tokenizer:
    """`byte` (or None), or a local tokenizer.json / Hugging Face tokenizer folder (`setting`: the
    option that named it, for errors)."""
    return ByteTokenizer() if spec in (None, "byte") else HFTokenizer(spec, setting)


# The files a Hugging Face tokenizer folder may hold (transformers' names); a checkpoint keeps a
# copy of those its tokenizer has, and an HF export carries them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def tokenizer_files(spec: str) -> dict[str, Path]:
    """The files that make up tokenizer `spec`, by their name in a tokenizer folder: none for
    `byte`, a bare tokenizer.json (whatever its name) as tokenizer.json, or a folder's files."""
    if spec == "byte":
        return {}
    path = Path(spec)
    if path.is_file():
        return {"tokenizer.json": path}
    return {name: path / name for name in TOKENIZER_FILES if (path / name).is_file()}


def save_hf_tokenizer(spec: str, out_dir: str | os.PathLike) -> bool:
    """Write tokenizer `spec` into `out_dir` as a folder that `transformers.AutoTokenizer` loads, with
    the delimiters codatrain uses; False for the byte tokenizer, which has no Hugging Face form."""
    files = tokenizer_files(spec)
    if not files:
        return False
    if "tokenizer_config.json" in files:
        for name, source in files.items():
            shutil.copyfile(source, Path(out_dir) / name)
        return True
    from transformers import PreTrainedTokenizerFast

    # A bare tokenizer.json: transformers needs its delimiters named in a tokenizer_config.json.
    tokenizer = HFTokenizer(files["tokenizer.json"])
    delimiters = {"eos_token": tokenizer.token(tokenizer.eos_id)}
    if tokenizer.bos_id is not None:
        delimiters["bos_token"] = tokenizer.token(tokenizer.bos_id)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(files["tokenizer.json"]), **delimiters)
    hf_tokenizer.save_pretrained(out_dir)
    return True


def folder_tokenizer(folder: str | os.PathLike | None) -> str | None:
    """`folder` when it holds a tokenizer (weights saved with theirs: an HF folder), else None."""
    if folder is None:
        return None
    path = Path(folder)
    found = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    return str(path) if found else None
