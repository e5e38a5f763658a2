"""data.val_fraction holds out the same documents on every path (token cache, token directory,
streaming, SFT), by content, and a data state saved under the old split by index is refused."""

import json
import re

import numpy as np
import pytest
import torch

from codatrain.data import build_loaders, prepare_streams
from codatrain.data.config import DataConfig, DataSource
from codatrain.data.pretokenize import tokenize_to_dir
from codatrain.data.sources import held_out_by_content

BOS = 256
FRACTION = 0.25


def corpus(folder, files=3, per_file=20):
    folder.mkdir()
    texts = []
    for f in range(files):
        rows = [f"doc {f}-{i} " + "words " * ((i * 5 + f) % 7 + 1) for i in range(per_file)]
        (folder / f"part{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
        texts += rows
    return texts


def build(cfg):
    return build_loaders(cfg, 2, 0, 1, 0, "cpu", max_seq_len=64, model_vocab_size=512)


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x.inputs, y.inputs)
                                    and torch.equal(x.documents.doc_index, y.documents.doc_index)
                                    for x, y in zip(a, b, strict=True))


def test_every_text_path_validates_on_the_same_documents(tmp_path):
    texts = corpus(tmp_path / "c")
    common = dict(seq_len=16, keep_document_boundaries=True, num_workers=0, shuffle=False,
                  cache_dir=str(tmp_path / "cache"))
    stored = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), val_fraction=FRACTION, **common)
    held = [t for t in texts if held_out_by_content(t, FRACTION)]
    assert 0 < len(held) < len(texts) / 2
    val = prepare_streams(stored).val
    assert bytes(t for t in val.read(0, val.num_tokens) if t < 256).decode() == "".join(held)

    tokenize_to_dir(stored, tmp_path / "tokens", shards=1, processes=1)
    tokens = DataConfig(source=DataSource.tokens, path=str(tmp_path / "tokens"), **common)
    streaming = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), val_fraction=FRACTION,
                           streaming=True, val_tokens=1 << 16, **common)
    batches = [list(build(cfg)[1]) for cfg in (stored, tokens, streaming)]
    assert len(batches[0]) > 2
    assert same(batches[0], batches[1]) and same(batches[0], batches[2])


def sft_validation(tmp_path, name, records):
    """The validation examples of an SFT file of `records`, as token tuples (plain template, bytes)."""
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(source="files", format="sft", path=str(path), seq_len=64, val_fraction=FRACTION,
                     shuffle=False, num_workers=0)
    val_tokens = build(cfg)[1].dataset.tokens
    return {tuple(example) for example in np.split(val_tokens, np.flatnonzero(val_tokens == BOS)[1:])}


def test_sft_holds_out_conversations_by_content_not_by_their_place(tmp_path):
    records = [{"prompt": f"question {i}", "response": "answer " * (i % 4 + 1)} for i in range(40)]
    held = sft_validation(tmp_path, "a.jsonl", records)
    assert 0 < len(held) < 20
    assert sft_validation(tmp_path, "reversed.jsonl", records[::-1]) == held
    # The same conversation written as messages is the same document.
    as_messages = [{"messages": [{"role": "user", "content": r["prompt"]},
                                 {"role": "assistant", "content": r["response"]}]} for r in records]
    assert sft_validation(tmp_path, "messages.jsonl", as_messages) == held


def test_the_conversations_held_out_of_a_file_stay_the_same(tmp_path):
    """Which conversations validate is fixed by their content (split version 2): a resumed run, a
    rerun or another release trains on none of the ones held out here, non-ASCII text included."""
    records = [{"prompt": f"¿pregunta {i}?", "response": "respuesta " * (i % 3 + 1)} for i in range(40)]
    held = sft_validation(tmp_path, "a.jsonl", records)
    prompts = sorted(int(re.search(r"pregunta (\d+)", bytes(t for t in example if t < 256).decode())[1])
                     for example in held)
    assert prompts == [0, 1, 6, 10, 23, 24, 28, 32, 34, 36, 37, 39]


def test_a_state_saved_under_the_split_by_index_is_refused_by_name(tmp_path):
    corpus(tmp_path / "c")
    cfg = DataConfig(source=DataSource.files, path=str(tmp_path / "c"), val_fraction=FRACTION, seq_len=16,
                     num_workers=0, cache_dir=str(tmp_path / "cache"))
    train = build(cfg)[0]
    old = {k: v for k, v in train.state_dict().items() if k != "split"}  # saved before the split by content
    with pytest.raises(ValueError, match="saved when data.val_fraction held out documents by their index "
                                         r"\(split version 1\)"):
        build(cfg)[0].load_state_dict(old)
    build(cfg)[0].load_state_dict(train.state_dict())
    # Without a held-out fraction the training documents did not change: an old state still resumes.
    whole = DataConfig(**{**cfg.__dict__, "val_fraction": 0.0})
    state = build(whole)[0].state_dict()
    del state["split"]
    build(whole)[0].load_state_dict(state)
