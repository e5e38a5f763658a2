"""The data config (`data.*`): where the tokens come from and how they are cut, its choices as
enums, and every check of its values. It imports neither Hydra nor the run schema, which
(codatrain/config.py) registers it as the run's `data` node; codatrain.data.build_loaders reads it.
The checks run when the dataclass is built, so a bad value fails at the start of a run, naming the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum


class DataSource(StrEnum):
    embedded = "embedded"
    synthetic = "synthetic"
    files = "files"
    hub = "hub"
    tokens = "tokens"  # a token directory written by scripts/tokenize_corpus.py


class OnBadData(StrEnum):
    fail = "fail"  # stop the run, naming the file and line or row
    skip = "skip"  # leave the row out and count it


class DataFormat(StrEnum):
    text = "text"  # documents: every token is a target (pretraining)
    sft = "sft"  # instruction examples: targets only on the assistant's tokens (codatrain/data/sft.py)


class SFTTemplate(StrEnum):
    auto = "auto"  # the tokenizer's chat template where it has one, else plain
    plain = "plain"  # [BOS] <|role|>\n content [EOS] ... for every tokenizer


class SFTOverlong(StrEnum):
    truncate = "truncate"
    drop = "drop"


class TextSampleBy(StrEnum):
    document = "document"
    paragraph = "paragraph"
    line = "line"


def expand_home(node: object, *names: str) -> None:
    """A leading `~` of the path fields `names`, expanded as a shell would: Hydra keeps it as it is,
    so `~/runs/x` would make a folder named `~` in the working directory."""
    for name in names:
        value = getattr(node, name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(node, name, os.path.expanduser(value))


def require_positive(node: object, prefix: str, *names: str) -> None:
    """ValueError naming `prefix.name` for the first of `names` of `node` that is not positive."""
    for name in names:
        value = getattr(node, name)
        if value <= 0:
            raise ValueError(f"{prefix}.{name} must be positive, got {value}")


def require_not_negative(node: object, prefix: str, *names: str) -> None:
    """ValueError naming `prefix.name` for the first of `names` of `node` that is negative."""
    for name in names:
        value = getattr(node, name)
        if value < 0:
            raise ValueError(f"{prefix}.{name} must be 0 or more, got {value}")


@dataclass
class DataConfig:
    """Where the tokens come from and how they are cut; codatrain.data.build_loaders reads it."""

    source: DataSource = DataSource.embedded  # where the documents come from (README: Data)
    path: str | None = None  # files: a file, a folder or a glob; hub: the dataset name; tokens: the directory
    name: str | None = None  # hub: dataset configuration name
    split: str = "train"  # hub: the training split
    # files, hub: tokenize in the DataLoader workers while training, no cache (sft: read records as a stream)
    streaming: bool = False
    on_bad_data: OnBadData = OnBadData.fail  # streaming: a bad line, row or file stops the run or is skipped
    val_tokens: int = 1 << 18  # streaming: size of the bounded validation set, in tokens
    text_column: str = "text"  # json / parquet / hub column holding the document text
    text_sample_by: TextSampleBy = TextSampleBy.document  # plain-text files: what one document is
    max_documents: int | None = None  # use only the first N documents of the source
    # byte | a local HF tokenizer.json or tokenizer folder; null: the tokenizer checkpoint.init_from
    # was trained with (a checkpoint's record, an HF folder's own) where known, else byte
    tokenizer: str | None = None
    seq_len: int = 128  # tokens per training sequence (windows of seq_len + 1 tokens)
    keep_document_boundaries: bool = False  # batches carry their documents (Batch.documents)
    val_fraction: float = 0.02  # held-out share of documents, when no val_path / val_split is given
    val_path: str | None = None  # a separate validation file, folder or glob (same formats as path)
    val_split: str | None = None  # hub: a separate validation split, e.g. "validation"
    num_workers: int = 1  # background DataLoader processes for training batches (0: main process)
    cache_dir: str | None = None  # token cache (and datasets' cache); default: the HF datasets cache
    shuffle: bool = True  # a new seeded order every epoch
    # streaming (with shuffle): documents drawn at random from a pool of this many, read ahead
    shuffle_buffer: int = 256
    format: DataFormat = DataFormat.text  # sft: chat `messages` or `prompt`/`response` records
    sft_template: SFTTemplate = SFTTemplate.auto  # sft: how a conversation becomes tokens
    sft_overlong: SFTOverlong = SFTOverlong.truncate  # sft: examples longer than seq_len + 1 tokens

    def __post_init__(self) -> None:
        expand_home(self, "path", "val_path", "tokenizer", "cache_dir")
        require_positive(self, "data", "seq_len", "val_tokens")
        require_not_negative(self, "data", "shuffle_buffer", "num_workers")
        if self.max_documents is not None:
            require_positive(self, "data", "max_documents")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"data.val_fraction={self.val_fraction} is not in [0, 1)")
        if self.streaming and self.source not in (DataSource.files, DataSource.hub):
            raise ValueError(f"data.streaming=true streams data.source=files or hub, not "
                             f"{str(self.source)!r}")
        if self.format == DataFormat.sft and self.source not in (DataSource.files, DataSource.hub):
            raise ValueError(f"data.format=sft reads JSON-lines files or a Hub dataset; it needs "
                             f"data.source=files or hub, not {str(self.source)!r}")

    @property
    def held_out_fraction(self) -> float:
        """The share of the source's documents held out for validation: val_fraction unless a
        separate validation set (val_path, or a Hub val_split) is given."""
        separate = self.val_path or (self.source == DataSource.hub and self.val_split)
        return 0.0 if separate else self.val_fraction
