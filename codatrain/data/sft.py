"""Fine-tuning data: instruction examples whose only targets are what the assistant says.

Records. One example per JSON line of a local file (`.jsonl`/`.json`, optionally `.gz`; a folder or
glob of them), or per row of a Hub dataset, either

    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
    {"prompt": "...", "response": "..."}        (a user turn and the assistant's reply)

A bad record (not an object, a missing field, an unknown role, an empty conversation, no assistant
message) stops the run with a message naming the file and line (or the dataset row).

Templates. With a tokenizer folder that has a chat template, the conversation is rendered by
`apply_chat_template`, and the targets are the tokens of each assistant turn as the template writes
it (its content and end-of-turn marker): the text the template adds for turn i is the rendering of
messages[:i+1] minus that of messages[:i] with the generation prompt. A template may write a turn
that more of the conversation follows otherwise than a last one (Qwen3's writes the <think> block
only in the turns after the last user message): such a turn ends where its content, as written, is
followed by the end-of-turn text the template writes after it as the last turn. Otherwise (the byte
tokenizer, a bare tokenizer.json, or `data.sft_template=plain`) the plain template is used:

    [BOS] <|role|>\\n content [EOS] <|role|>\\n content [EOS] ...

with the header of every message written as text, and targets on each assistant content and the
EOS that ends it (so the model learns to stop).

Packing. Examples are laid back to back, in the records' order, into windows of seq_len + 1 slots
(inputs are the first seq_len, targets the last seq_len, as in pretraining); a window holds whole
examples only and the rest of it is padding (EOS tokens, no targets, a document of their own). An
example longer than a window is cut to its first seq_len + 1 tokens or dropped
(`data.sft_overlong`); one left without targets is dropped. Document ids (`Window.doc_ids`) mark the
examples of a window as they mark a pretraining window's documents.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from codatrain.data.config import DataConfig, DataSource, SFTOverlong, SFTTemplate
from codatrain.data.packing import Window
from codatrain.data.sources import DataFileError, held_out_by_content, load_dataset, resolve_files
from codatrain.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")
PLAIN_HEADER = "<|{role}|>\n"  # the plain template's text before a message's content
_JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # (n,) int64
    is_target: np.ndarray  # (n,) bool: the loss counts the prediction of this token


# ---- records -----------------------------------------------------------------------------------


def read_local_records(path: str) -> Iterator[tuple[str, Any]]:
    """(where, record) for every non-blank line of the JSON-lines files that `path` names."""
    for file in resolve_files(path):
        if not file.name.lower().endswith(_JSON_SUFFIXES):
            raise ValueError(f"data path {path!r}: {file} is not a JSON-lines file "
                             f"({', '.join(_JSON_SUFFIXES)})")
        opener = gzip.open if file.suffix.lower() == ".gz" else open
        number = 0
        try:
            with opener(file, "rb") as lines:
                for number, raw in enumerate(lines, start=1):
                    where = f"{file} line {number}"
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as error:
                        raise DataFileError(f"{where}: not UTF-8 text ({error.reason} at byte "
                                            f"{error.start} of the line); is it a binary file?") from None
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise DataFileError(f"{where}: not valid JSON ({error.msg})") from None
                    yield where, record
        except (OSError, EOFError) as error:  # a broken or truncated gzip: the file, and how far it read
            reached = f" after line {number}" if number else ""
            raise DataFileError(f"{file}: cannot be read as JSON lines{reached} "
                                f"({type(error).__name__}: {error})") from None


def read_hub_records(name: str, config_name: str | None, split: str, streaming: bool,
                     cache_dir: str | None) -> Iterator[tuple[str, Any]]:
    """(where, record) for every row of a Hub dataset split."""
    rows = load_dataset(path=name, name=config_name, split=split, streaming=streaming, cache_dir=cache_dir)
    for index, row in enumerate(rows):
        yield f"{name}[{split}] row {index}", row


def to_messages(record: Any, where: str) -> Messages:
    """The conversation of one record, checked; raises ValueError naming `where`."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: `messages` must be a non-empty list of role/content objects")
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"{where}: message {i} needs a string `role` and a string `content`")
            if message["role"] not in ROLES:
                raise ValueError(f"{where}: message {i} has the unknown role {message['role']!r} "
                                 f"(known: {', '.join(ROLES)})")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the conversation has no assistant message, so nothing to learn")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if "prompt" in record or "response" in record:
        for key in ("prompt", "response"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: `{key}` is missing or not a string")
        return [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]}]
    raise ValueError(f"{where}: a record needs `messages` (role/content objects) or `prompt` and "
                     f"`response`; it has {', '.join(map(repr, record)) or 'no fields'}")


# ---- templates ---------------------------------------------------------------------------------

Encoder = Callable[[Messages, str], Example]


def plain_encoder(tokenizer: Tokenizer) -> Encoder:
    """The plain template of the module docstring, for any tokenizer."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]

    def encode(messages: Messages, where: str) -> Example:
        headers = tokenizer.encode_batch([PLAIN_HEADER.format(role=m["role"]) for m in messages])
        contents = tokenizer.encode_batch([m["content"] for m in messages])
        tokens, is_target = [np.asarray(bos, dtype=np.int64)], [np.zeros(len(bos), dtype=bool)]
        for message, header, content in zip(messages, headers, contents, strict=True):
            learn = message["role"] == "assistant"
            tokens += [header.astype(np.int64), content.astype(np.int64), np.array([tokenizer.eos_id])]
            is_target += [np.zeros(len(header), dtype=bool), np.full(len(content) + 1, learn)]
        return Example(np.concatenate(tokens), np.concatenate(is_target))

    return encode


def chat_template_encoder(hf_tokenizer: Any) -> Encoder:
    """Render with the tokenizer's chat template; targets are the assistant turns' tokens."""

    def render(messages: Messages, where: str, generation_prompt: bool = False) -> str:
        try:
            return hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=generation_prompt)
        except Exception as error:  # the template's own checks (e.g. roles must alternate)
            raise ValueError(f"{where}: the tokenizer's chat template refused the conversation: "
                             f"{error}") from None

    def encode(messages: Messages, where: str) -> Example:
        text = render(messages, where)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = render(messages[:i], where, generation_prompt=True)
            through = render(messages[: i + 1], where)
            if text.startswith(before) and text.startswith(through) and len(through) >= len(before):
                end = len(through)
            elif text.startswith(before):
                end = _end_of_an_earlier_turn(text, len(before), through, message["content"])
            else:
                end = None
            if end is None:
                raise ValueError(
                    f"{where}: the tokenizer's chat template does not render a conversation as the "
                    "rendering of its first turns plus more text, so the assistant's tokens cannot be "
                    "found; use data.sft_template=plain"
                )
            spans.append((len(before), end))
        encoding = hf_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        starts = np.array([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
        is_target = np.zeros(len(starts), dtype=bool)
        for begin, end in spans:
            is_target |= (starts >= begin) & (starts < end)
        return Example(np.asarray(encoding["input_ids"], dtype=np.int64), is_target)

    return encode


def _end_of_an_earlier_turn(text: str, start: int, through: str, content: str) -> int | None:
    """Where in `text` an assistant turn that starts at `start` ends, for a template that writes the
    turn otherwise when it is the last (`through`): after its content, the first time `text` holds it
    from `start`, and the end-of-turn text that follows the content in `through`. None when `text`
    has no such ending (the template rewrites more than the turn's opening)."""
    content = content.strip()
    found, in_through = text.find(content, start), through.rfind(content)
    if not content or found < 0 or in_through < 0:
        return None
    closing = through[in_through + len(content):]
    end = found + len(content)
    return end + len(closing) if closing and text.startswith(closing, end) else None


def templated_tokenizer(spec: str | None, template: SFTTemplate) -> Any | None:
    """The transformers tokenizer whose chat template renders conversations: that of tokenizer
    folder `spec` when it has a chat template and `template` is auto, else None (the plain one)."""
    folder = Path(spec or "byte")
    if template == SFTTemplate.auto and (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if hf_tokenizer.chat_template:
            return hf_tokenizer
    return None


def make_encoder(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[Encoder, str]:
    """The encoder of `cfg` and the name of its template, for the run's report."""
    hf_tokenizer = templated_tokenizer(cfg.tokenizer, cfg.sft_template)
    if hf_tokenizer is not None:
        return chat_template_encoder(hf_tokenizer), "the tokenizer's chat template"
    return plain_encoder(tokenizer), "the plain template"


def generation_prompt(messages: Messages, spec: str | None, tokenizer: Tokenizer,
                      template: SFTTemplate = SFTTemplate.auto) -> tuple[list[int], str]:
    """The tokens that ask for the assistant's next turn after `messages`, rendered as fine-tuning
    renders conversations (`templated_tokenizer`'s chat template with its generation prompt, or the
    plain template then the assistant's header), and the name of the template."""
    hf_tokenizer = templated_tokenizer(spec, template)
    if hf_tokenizer is not None:
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return hf_tokenizer(text, add_special_tokens=False)["input_ids"], "the tokenizer's chat template"
    tokens = plain_encoder(tokenizer)(messages, "the prompt").tokens.tolist()
    header = tokenizer.encode_batch([PLAIN_HEADER.format(role="assistant")])[0].tolist()
    return tokens + header, "the plain template"


# ---- packing -----------------------------------------------------------------------------------


@dataclass
class PackingReport:
    examples: int = 0  # records read
    windows: int = 0
    truncated: int = 0  # cut to the window (and kept)
    dropped_long: int = 0  # longer than the window, with data.sft_overlong=drop
    dropped_no_target: int = 0  # no target (left after truncation)
    tokens: int = 0  # tokens of the kept examples
    targets: int = 0


class SFTWindows(torch.utils.data.Dataset):
    """Map-style dataset of packed windows of examples; item i is a `Window` with a target mask."""

    def __init__(self, examples: list[Example], seq_len: int, with_doc_ids: bool,
                 overlong: SFTOverlong, pad_id: int) -> None:
        self.seq_len, self.with_doc_ids, self.pad_id = seq_len, with_doc_ids, pad_id
        report = PackingReport(examples=len(examples))
        slots = seq_len + 1
        kept: list[Example] = []
        window_starts, used = [0], 0  # window_starts: offsets of each window's first token
        for example in examples:
            overlong_example = len(example.tokens) > slots
            if overlong_example and overlong == SFTOverlong.drop:
                report.dropped_long += 1
                continue
            example = Example(example.tokens[:slots], example.is_target[:slots])
            if not example.is_target[1:].any():  # the first token is never predicted within it
                report.dropped_no_target += 1
                continue
            report.truncated += overlong_example
            if used + len(example.tokens) > slots:
                window_starts.append(window_starts[-1] + used)
                used = 0
            kept.append(example)
            used += len(example.tokens)
        if not kept:
            raise ValueError(f"none of the {len(examples)} examples has a target token left in a window "
                             f"of {slots} tokens; raise data.seq_len")
        window_starts.append(window_starts[-1] + used)
        self.tokens = np.concatenate([e.tokens for e in kept])
        is_target = np.concatenate([e.is_target for e in kept])
        # Within a window every example's first token follows another example (or nothing).
        self.example_starts = np.cumsum([0] + [len(e.tokens) for e in kept])
        is_target[self.example_starts[:-1]] = False
        self.is_target = is_target
        self.window_starts = np.asarray(window_starts, dtype=np.int64)
        report.windows = len(self.window_starts) - 1
        report.tokens, report.targets = len(self.tokens), int(is_target.sum())
        self.report = report

    def __len__(self) -> int:
        return len(self.window_starts) - 1

    def __getitem__(self, i: int) -> Window:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        begin, end = self.window_starts[i], self.window_starts[i + 1]
        filled = end - begin
        tokens = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        tokens[:filled] = self.tokens[begin:end]
        is_target = np.zeros(self.seq_len + 1, dtype=bool)
        is_target[:filled] = self.is_target[begin:end]
        doc_ids = None
        if self.with_doc_ids:
            real = min(filled, self.seq_len)  # input tokens that belong to an example
            doc_ids = np.empty(self.seq_len, dtype=np.int64)
            doc_ids[:real] = np.searchsorted(self.example_starts, np.arange(begin, begin + real),
                                             side="right") - 1
            doc_ids[real:] = doc_ids[real - 1] + 1  # padding is a document of its own
            doc_ids = (doc_ids - doc_ids[0]).astype(np.int32)
        return Window(tokens, doc_ids, is_target[1:])

    def describe(self, name: str, template: str, overlong: SFTOverlong) -> str:
        """One line for the run's log: what was packed and what did not fit."""
        r = self.report
        fill = r.tokens / (r.windows * (self.seq_len + 1))
        line = (f"{name} data: {r.examples} examples ({template}) in {r.windows} windows of "
                f"{self.seq_len + 1} tokens, {fill:.0%} filled, {r.targets} target tokens")
        if overlong == SFTOverlong.truncate:
            line += f"; {r.truncated} longer than a window truncated"
        else:
            line += f"; {r.dropped_long} longer than a window dropped"
        return line + f", {r.dropped_no_target} without a target dropped"


def build_sft_datasets(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[SFTWindows, SFTWindows | None,
                                                                        list[str | None]]:
    """(train windows, validation windows or None, [train report, validation report or None]) of an
    sft data config; the reports are lines for the run's log."""
    encode, template = make_encoder(cfg, tokenizer)

    def encode_all(records: Iterator[tuple[str, Any]], limit: int | None,
                   held_out_fraction: float = 0.0) -> tuple[list[Example], list[Example]]:
        """(kept, held out) examples of the first `limit` records; a conversation is held out by
        its canonical text, so a `prompt`/`response` record and the same `messages` agree."""
        kept: list[Example] = []
        held: list[Example] = []
        for index, (where, record) in enumerate(records):
            if limit is not None and index >= limit:
                break
            messages = to_messages(record, where)
            text = json.dumps(messages, ensure_ascii=False, sort_keys=True)
            out = held_out_fraction > 0 and held_out_by_content(text, held_out_fraction)
            (held if out else kept).append(encode(messages, where))
        return kept, held

    held_out = cfg.held_out_fraction
    if cfg.source == DataSource.files:
        if not cfg.path:
            raise ValueError("data.format=sft with data.source=files needs data.path (a JSON-lines file, "
                             "folder or glob)")
        main, val = encode_all(read_local_records(cfg.path), cfg.max_documents, held_out)
    else:
        if not cfg.path:
            raise ValueError("data.format=sft with data.source=hub needs data.path (the dataset name)")
        main, val = encode_all(read_hub_records(cfg.path, cfg.name, cfg.split, cfg.streaming, cfg.cache_dir),
                               cfg.max_documents, held_out)
    if cfg.val_path:
        val = encode_all(read_local_records(cfg.val_path), None)[0]
    elif cfg.source == DataSource.hub and cfg.val_split:
        val = encode_all(read_hub_records(cfg.path, cfg.name, cfg.val_split, cfg.streaming,
                                          cfg.cache_dir), None)[0]
    elif held_out == 0:
        val = None
    elif not val:
        raise ValueError(f"data.val_fraction={cfg.val_fraction} holds out none of the {len(main)} "
                         "examples; raise it or give data.val_path")
    if not main and val and held_out > 0:
        raise ValueError(f"data.val_fraction={cfg.val_fraction} holds out all {len(val)} examples, leaving "
                         "none to train on; lower it or give data.val_path")

    def pack(examples: list[Example]) -> SFTWindows:
        return SFTWindows(examples, cfg.seq_len, cfg.keep_document_boundaries, cfg.sft_overlong,
                          tokenizer.eos_id)

    train_set = pack(main)
    val_set = None if val is None else pack(val)
    reports = [train_set.describe("training", template, cfg.sft_overlong),
               None if val_set is None else val_set.describe("validation", template, cfg.sft_overlong)]
    return train_set, val_set, reports
