"""Local file sources, Hugging Face tokenizers, the token cache, end-to-end resume, and bad input."""

import gzip
import json
from itertools import islice

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from codatrain.config import DataConfig
from codatrain.data import build_loaders, prepare_streams
from codatrain.data.sft import read_hub_records
from codatrain.data.sources import DataFileError, Source, held_out_by_content, hub_source
from codatrain.data.token_cache import tokenize_source
from codatrain.data.tokenizer import ByteTokenizer

WORDS = ["hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


def docs(n=30):
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 5)) for i in range(n)]


def write_jsonl(path, texts, column="text"):
    path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def config(tmp_path, path, **overrides):
    fields = dict(source="files", path=str(path), seq_len=8, val_fraction=0.0, num_workers=0,
                  cache_dir=str(tmp_path / "cache"))
    return DataConfig(**{**fields, **overrides})


def build(cfg, batch_size=2, max_seq_len=64, model_vocab_size=512, rank=0, world_size=1):
    return build_loaders(cfg, batch_size, rank, world_size, 0, "cpu", max_seq_len=max_seq_len,
                         model_vocab_size=model_vocab_size)


def read_all(stream):
    return stream.read(0, stream.num_tokens).tolist()


def stream_text(cfg, part="train"):
    return bytes(t for t in read_all(getattr(prepare_streams(cfg), part)) if t < 256).decode()


# ---- sources ---------------------------------------------------------------------------------------
def test_jsonl_with_a_configured_text_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", docs(), column="content")
    assert stream_text(config(tmp_path, path, text_column="content")) == "".join(docs())


def test_parquet_folder_and_compressed_jsonl(tmp_path):
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": docs()[:15]}), tmp_path / "pq" / "a.parquet")
    pq.write_table(pa.table({"text": docs()[15:]}), tmp_path / "pq" / "b.parquet")
    assert stream_text(config(tmp_path, tmp_path / "pq")) == "".join(docs())
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in docs()))
    assert stream_text(config(tmp_path, tmp_path / "d.jsonl.gz")) == "".join(docs())


def test_text_files_by_document_and_paragraph_and_glob(tmp_path):
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "1.txt").write_text("first file\n\nsecond paragraph\n")
    (tmp_path / "txt" / "2.txt").write_text("another file\n")
    streams = prepare_streams(config(tmp_path, tmp_path / "txt"))
    assert streams.train.num_documents == 2
    assert stream_text(config(tmp_path, tmp_path / "txt")) == "first file\n\nsecond paragraph\nanother file\n"
    by_paragraph = prepare_streams(config(tmp_path, tmp_path / "txt", text_sample_by="paragraph"))
    assert by_paragraph.train.num_documents == 3
    globbed = prepare_streams(config(tmp_path, str(tmp_path / "txt" / "2.*")))
    assert globbed.train.num_documents == 1


def test_separate_validation_path(tmp_path):
    train_path = write_jsonl(tmp_path / "train.jsonl", docs())
    val_path = write_jsonl(tmp_path / "val.jsonl", ["held out text only"] * 4)
    cfg = config(tmp_path, train_path, val_path=str(val_path), val_fraction=0.5)
    assert stream_text(cfg) == "".join(docs())  # val_path replaces the held-out fraction
    assert stream_text(cfg, "val") == "held out text only" * 4
    _, val = build(cfg)
    assert len(val) > 0


def test_tokens_are_cached(tmp_path, monkeypatch):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl", docs()))
    first = prepare_streams(cfg).train
    monkeypatch.setattr(Source, "read", lambda *a, **k: pytest.fail("tokenized twice"))
    assert prepare_streams(cfg).train.stems == first.stems
    # Another tokenization of the same source is another cache entry.
    monkeypatch.undo()
    assert prepare_streams(config(tmp_path, cfg.path, val_fraction=0.2)).train.stems[0].parent != \
        first.stems[0].parent


def test_a_stream_is_read_once_into_the_cache(tmp_path):
    """The Hub's streaming path, exercised offline: load_dataset(streaming=True) on a local file."""
    path = write_jsonl(tmp_path / "d.jsonl", docs())
    load_args = {"path": "json", "data_files": str(path), "split": "train", "streaming": True}
    stream = Source("hub", "a local stream", "text", {"stream": str(path)}, load_args, max_documents=5)
    parts = tokenize_source(stream, ByteTokenizer(), tmp_path / "cache", held_out_fraction=0.0)
    text = bytes(t for t in parts["train"].read(0, parts["train"].num_tokens) if t < 256).decode()
    assert text == "".join(docs()[:5])


def test_a_hub_dataset_out_of_reach_is_one_line_naming_it(monkeypatch):
    def unreachable(path, **kwargs):  # what datasets raises offline for a dataset not in its cache
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    named = r"^data.path=someone/corpus: Couldn't reach 'someone/corpus' on the Hub .*HF_DATASETS_OFFLINE=1"
    for streaming in (False, True):
        source = hub_source("someone/corpus", None, "train", streaming, "text", None, None)
        with pytest.raises(DataFileError, match=named):
            source.stream() if streaming else source.read()
    with pytest.raises(DataFileError, match=named):  # SFT examples from the Hub
        next(read_hub_records("someone/corpus", None, "train", False, None))


# ---- Hugging Face tokenizers -----------------------------------------------------------------------
def word_tokenizer(specials):
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return tok, vocab


def test_hf_tokenizer_json(tmp_path):
    tok, vocab = word_tokenizer(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    path = write_jsonl(tmp_path / "d.jsonl", docs())
    cfg = config(tmp_path, path, tokenizer=str(tmp_path / "tokenizer.json"))
    train, _ = build(cfg, model_vocab_size=16)
    assert train.vocab_size == 13
    expected = sum(([vocab["<s>"], *(vocab[w] for w in d.split()), vocab["</s>"]] for d in docs()), [])
    assert read_all(prepare_streams(cfg).train) == expected
    batch = next(iter(train))
    assert batch.inputs.shape == (2, 8) and int(batch.inputs.max()) < 13


@pytest.mark.parametrize("folder", [False, True], ids=["tokenizer.json", "folder"])
def test_a_document_that_writes_a_special_token_keeps_it_as_text(tmp_path, folder):
    """"</s>" in a document's text was encoded as the EOS id: a document boundary inside the document."""
    from transformers import PreTrainedTokenizerFast

    tok, vocab = word_tokenizer(["<s>", "</s>"])
    if folder:
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    else:
        tok.save(str(tmp_path / "tokenizer.json"))
    path = write_jsonl(tmp_path / "d.jsonl", ["hello </s> <s> world"])
    cfg = config(tmp_path, path, tokenizer=str(tmp_path / "tok" if folder else tmp_path / "tokenizer.json"))
    tokens = read_all(prepare_streams(cfg).train)
    assert tokens[0] == vocab["<s>"] and tokens[1] == vocab["hello"]
    assert tokens[-2] == vocab["world"] and tokens[-1] == vocab["</s>"]
    assert tokens.count(vocab["<s>"]) == 1 and tokens.count(vocab["</s>"]) == 1


def test_hf_tokenizer_folder_names_its_delimiters(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok, vocab = word_tokenizer(["[START]", "[END]"])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[START]", eos_token="[END]",
                            unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    path = write_jsonl(tmp_path / "d.jsonl", ["hello world"])
    cfg = config(tmp_path, path, tokenizer=str(tmp_path / "tok"))
    tokens = read_all(prepare_streams(cfg).train)
    assert tokens == [vocab["[START]"], vocab["hello"], vocab["world"], vocab["[END]"]]


def test_hf_tokenizer_with_only_an_end_of_text_token(tmp_path):
    tok, vocab = word_tokenizer(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl", ["hello", "world"]), tokenizer=str(tmp_path))
    eot = vocab["<|endoftext|>"]
    tokens = read_all(prepare_streams(cfg).train)
    assert tokens == [vocab["hello"], eot, vocab["world"], eot]


def test_a_tokenizer_folder_without_its_vocabulary_is_refused(tmp_path):
    # A Qwen2 folder's tokenizer_config.json without its tokenizer.json (an incomplete download):
    # transformers 5 loads the special tokens alone, so every document would be just BOS and EOS
    # (SFT trained on them without a word).
    from transformers import PreTrainedTokenizerFast

    tok, _ = word_tokenizer(["[START]", "[END]"])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[START]", eos_token="[END]", unk_token="[UNK]"
    ).save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").unlink()
    (tmp_path / "tok" / "config.json").write_text('{"model_type": "qwen2"}')
    path = write_jsonl(tmp_path / "d.jsonl", ["hello world"])
    cfg = config(tmp_path, path, tokenizer=str(tmp_path / "tok"))
    with pytest.raises(ValueError, match="turns text into no tokens: it has no vocabulary beyond"):
        prepare_streams(cfg)


# ---- end to end resume -----------------------------------------------------------------------------
def test_resume_of_real_data_with_workers_and_boundaries(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl", docs(60)), keep_document_boundaries=True,
                 num_workers=2)
    reference, _ = build(cfg, batch_size=4, rank=1, world_size=2)
    steps = 2 * len(reference) + 3  # crosses two epoch boundaries
    expected = list(islice(reference, steps))
    got, state = [], None
    for stop in (len(reference) - 1, len(reference) + 2, steps):
        loader, _ = build(cfg, batch_size=4, rank=1, world_size=2)
        if state is not None:
            loader.load_state_dict(state)
        got += list(islice(loader, stop - len(got)))
        state = loader.state_dict()
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert torch.equal(a.documents.doc_index, b.documents.doc_index)


# ---- bad input -------------------------------------------------------------------------------------
def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        build(config(tmp_path, tmp_path / "nothing.jsonl"))
    with pytest.raises(FileNotFoundError, match="matches no files"):
        build(config(tmp_path, str(tmp_path / "*.parquet")))
    with pytest.raises(ValueError, match="needs data.path"):
        build(DataConfig(source="files", seq_len=8))


def test_empty_dataset(tmp_path):
    with pytest.raises(ValueError, match="no documents"):
        build(config(tmp_path, write_jsonl(tmp_path / "d.jsonl", ["", ""])))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty folder"):
        build(config(tmp_path, tmp_path / "empty"))


def test_missing_text_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", docs(), column="body")
    with pytest.raises(ValueError, match=r"text column 'text' is not in .*columns: body, id"):
        build(config(tmp_path, path))


def test_unknown_or_mixed_formats(tmp_path):
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", docs())
    (tmp_path / "mixed" / "b.txt").write_text("text")
    with pytest.raises(ValueError, match="mixes formats"):
        build(config(tmp_path, tmp_path / "mixed"))
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(ValueError, match="unknown format"):
        build(config(tmp_path, tmp_path / "data.xml"))


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl", docs()))
    with pytest.raises(ValueError, match=r"258 token ids, more than model.vocab_size=256"):
        build(cfg, model_vocab_size=256)
    tok, _ = word_tokenizer(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="13 token ids"):
        build(config(tmp_path, cfg.path, tokenizer=str(tmp_path / "tokenizer.json")), model_vocab_size=12)


def test_bad_tokenizers(tmp_path):
    cfg = config(tmp_path, write_jsonl(tmp_path / "d.jsonl", docs()), tokenizer=str(tmp_path / "none.json"))
    with pytest.raises(FileNotFoundError, match="none.json"):
        build(cfg)
    tok, _ = word_tokenizer([])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="no end-of-text token"):
        build(config(tmp_path, cfg.path, tokenizer=str(tmp_path / "tokenizer.json")))


def test_sequence_longer_than_the_model_supports(tmp_path):
    with pytest.raises(ValueError, match=r"data.seq_len=128 exceeds model.max_seq_len=64"):
        build(config(tmp_path, tmp_path / "unused.jsonl", seq_len=128), max_seq_len=64)


def test_too_little_data_or_validation(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["tiny"])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        build(config(tmp_path, path), batch_size=4)
    with pytest.raises(ValueError, match="holds out none"):
        build(config(tmp_path, write_jsonl(tmp_path / "e.jsonl", docs(3)), val_fraction=0.01))


def test_a_val_fraction_that_holds_out_every_document_says_so(tmp_path):
    """It said 'has no documents with text (3 rows read ...)' of a source of three documents."""
    texts = docs(3)
    assert all(held_out_by_content(t, 0.999) for t in texts)
    with pytest.raises(ValueError, match=r"data.val_fraction=0.999 holds out all 3 documents of .*d\.jsonl"):
        build(config(tmp_path, write_jsonl(tmp_path / "d.jsonl", texts), val_fraction=0.999))
