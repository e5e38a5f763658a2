"""Fine-tuning data (data.format=sft): records, templates, the assistant-only targets, packing,
truncation, bad records, the loader's resume and sharding."""

import gzip
import json
from itertools import islice

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from codatrain.config import DataConfig, load_config, validate
from codatrain.data import build_loaders
from codatrain.data.config import SFTOverlong
from codatrain.data.sft import Example, SFTWindows, generation_prompt, make_encoder, to_messages
from codatrain.data.sources import DataFileError
from codatrain.data.tokenizer import ByteTokenizer, load_tokenizer
from codatrain.model.llama import IGNORE_INDEX

BOS, EOS = 256, 257
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sft_config(tmp_path, path, **overrides):
    settings = dict(source="files", format="sft", path=str(path), seq_len=32, val_fraction=0.0,
                    shuffle=False, num_workers=0, keep_document_boundaries=True)
    return DataConfig(**(settings | overrides))


def build(cfg, batch_size=1, rank=0, world_size=1):
    return build_loaders(cfg, batch_size, rank, world_size, 0, "cpu", max_seq_len=256, model_vocab_size=512)


def plain(cfg=None):
    return make_encoder(cfg or DataConfig(format="sft", source="files"), ByteTokenizer())[0]


# ---- templates and targets -------------------------------------------------------------------------
def test_plain_template_targets_exactly_the_assistant_turns():
    example = plain()(CONVERSATION, "hand-written")
    expected, targets = [BOS], [False]
    for message in CONVERSATION:
        header, content = list(f"<|{message['role']}|>\n".encode()), list(message["content"].encode())
        learn = message["role"] == "assistant"
        expected += header + content + [EOS]
        targets += [False] * len(header) + [learn] * (len(content) + 1)
    assert example.tokens.tolist() == expected
    assert example.is_target.tolist() == targets
    decoded = bytes(t for t in example.tokens[example.is_target].tolist() if t < 256)  # a boolean mask
    assert decoded == b"Hello!4"


def test_a_tokenizer_without_bos_starts_the_plain_template_with_the_first_header(tmp_path):
    """A GPT-2 style tokenizer (one delimiter, no BOS): the example and the generation prompt are
    int64 token ids from the first header on."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "<|endoftext|>", "<|", "|>", "user", "assistant", "hi",
                                         "hello"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|endoftext|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    spec = str(tmp_path / "tokenizer.json")
    tokenizer = load_tokenizer(spec)
    assert tokenizer.bos_id is None and tokenizer.eos_id == vocab["<|endoftext|>"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    encode = make_encoder(DataConfig(format="sft", source="files", tokenizer=spec), tokenizer)[0]
    example = encode(messages, "x")
    words = ["<|", "user", "|>", "hi", "<|endoftext|>", "<|", "assistant", "|>", "hello", "<|endoftext|>"]
    assert example.tokens.dtype == np.int64 and example.tokens.tolist() == [vocab[w] for w in words]
    assert example.tokens[example.is_target].tolist() == [vocab["hello"], vocab["<|endoftext|>"]]
    prompt, _ = generation_prompt(messages[:1], spec, tokenizer)
    assert torch.tensor(prompt).dtype == torch.int64  # what generation feeds the model
    assert prompt == [vocab[w] for w in words[:5] + ["<|", "assistant", "|>"]]


def test_prompt_and_response_are_a_user_turn_and_the_reply():
    assert to_messages({"prompt": "p", "response": "r"}, "x") == [
        {"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]


WORDS = ["what", "is", "two", "plus", "four", "hi", "hello", "be", "brief", "system", "user", "assistant"]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def chat_tokenizer(folder, template=CHATML):
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    vocab |= {s: len(WORDS) + 1 + i for i, s in enumerate(SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            chat_template=template).save_pretrained(folder)
    return {i: w for w, i in vocab.items()}


WORD_CHAT = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"},
             {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def targeted_words(example, words):
    """(word, is it a target) for each token of `example`."""
    return [(words[t], bool(m)) for t, m in zip(example.tokens.tolist(), example.is_target, strict=True)]


def test_chat_template_targets_the_assistant_turns_as_the_template_writes_them(tmp_path):
    words = chat_tokenizer(tmp_path / "tok")
    cfg = DataConfig(format="sft", source="files", tokenizer=str(tmp_path / "tok"))
    encode, template = make_encoder(cfg, load_tokenizer(cfg.tokenizer))
    assert template == "the tokenizer's chat template"
    expected = []
    for m in WORD_CHAT:  # the assistant's words and its end-of-turn marker are the targets
        learn = m["role"] == "assistant"
        expected += [("<|im_start|>", False), (m["role"], False), *((w, learn) for w in m["content"].split()),
                     ("<|im_end|>", learn)]
    assert targeted_words(encode(WORD_CHAT, "hand-written"), words) == expected

    # sft_template=plain ignores the tokenizer's template.
    cfg = DataConfig(format="sft", source="files", tokenizer=str(tmp_path / "tok"), sft_template="plain")
    assert make_encoder(cfg, load_tokenizer(cfg.tokenizer))[1] == "the plain template"


# As Qwen3's: an empty <think> block opens the assistant turns after the last user message only, so a
# turn is written with it when it ends the conversation and without it when more follows.
THINKING = ("{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
            "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }} "
            "{% if m['role'] == 'assistant' and loop.index0 > ns.last %}<think> </think> {% endif %}"
            "{{ m['content'] }}<|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def test_a_template_that_writes_earlier_assistant_turns_without_their_opening_targets_them(tmp_path):
    words = chat_tokenizer(tmp_path / "tok", THINKING)
    cfg = DataConfig(format="sft", source="files", tokenizer=str(tmp_path / "tok"))
    encode = make_encoder(cfg, load_tokenizer(cfg.tokenizer))[0]
    expected = []
    for i, m in enumerate(WORD_CHAT):
        learn = m["role"] == "assistant"
        opening = [("<think>", True), ("</think>", True)] if i == len(WORD_CHAT) - 1 else []
        expected += [("<|im_start|>", False), (m["role"], False), *opening,
                     *((w, learn) for w in m["content"].split()), ("<|im_end|>", learn)]
    assert targeted_words(encode(WORD_CHAT, "row 1"), words) == expected


@pytest.mark.parametrize("template", [
    "{{ messages | length }}" + CHATML,  # the turn count first: the start of the text changes
    # a last assistant turn ends in another marker: the turns through an assistant's are no prefix
    CHATML.replace("<|im_end|> {% endfor %}", "{% if loop.last and m['role'] == 'assistant' %}</s>"
                                              "{% else %}<|im_end|> {% endif %}{% endfor %}"),
])
def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, template):
    chat_tokenizer(tmp_path / "tok", template)
    cfg = DataConfig(format="sft", source="files", tokenizer=str(tmp_path / "tok"))
    encode = make_encoder(cfg, load_tokenizer(cfg.tokenizer))[0]
    with pytest.raises(ValueError) as error:
        encode(CONVERSATION, "row 3")
    assert str(error.value) == (
        "row 3: the tokenizer's chat template does not render a conversation as the rendering of its first "
        "turns plus more text, so the assistant's tokens cannot be found; use data.sft_template=plain")


def test_the_rendered_text_is_tokenized_without_the_tokenizers_own_bos(tmp_path):
    """The template writes every special token; a tokenizer that prepends BOS must not add another,
    in fine-tuning examples and generation prompts alike."""
    words = chat_tokenizer(tmp_path / "tok")
    file = str(tmp_path / "tok/tokenizer.json")
    tok = Tokenizer.from_file(file)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(file)
    cfg = DataConfig(format="sft", source="files", tokenizer=str(tmp_path / "tok"))
    example = make_encoder(cfg, load_tokenizer(cfg.tokenizer))[0](CONVERSATION, "row 3")
    assert words[example.tokens[0]] == "<|im_start|>" and bos not in example.tokens
    prompt = generation_prompt(CONVERSATION[:2], cfg.tokenizer, load_tokenizer(cfg.tokenizer))[0]
    assert words[prompt[0]] == "<|im_start|>" and bos not in prompt


def test_assistant_turns_a_template_does_not_write_have_no_targets(tmp_path):
    # No assistant turn and no generation prompt: the text through an assistant turn is the text before it.
    template = "{% for m in messages if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }} {% endfor %}"
    chat_tokenizer(tmp_path / "tok", template)
    cfg = DataConfig(format="sft", source="files", tokenizer=str(tmp_path / "tok"))
    example = make_encoder(cfg, load_tokenizer(cfg.tokenizer))[0](CONVERSATION, "row 3")
    assert len(example.tokens) and not example.is_target.any()


# ---- bad records --------------------------------------------------------------------------------
@pytest.mark.parametrize("record, message", [
    ({"text": "hello", "id": 3}, r"a record needs `messages` .* or `prompt` and `response`; it has 'text', "
                                 r"'id'$"),
    ({}, r"a record needs `messages` .* or `prompt` and `response`; it has no fields$"),
    ({"prompt": "only a prompt"}, r"`response` is missing"),
    ({"response": "only a reply"}, r"`prompt` is missing or not a string$"),
    ({"messages": []}, r"`messages` must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"message 0 has the unknown role 'robot' "
                                                         r"\(known: system, user, assistant\)$"),
    ({"messages": [{"role": "user"}]}, r"message 0 needs a string `role` and a string `content`"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"the conversation has no assistant message"),
    ([1, 2], r"a record must be a JSON object, got list"),
    ('{"prompt": "unterminated', r"not valid JSON"),
])
def test_bad_records_name_the_file_and_line(tmp_path, record, message):
    good = {"prompt": "p", "response": "r"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, record])
    with pytest.raises(ValueError, match=rf"bad.jsonl line 3: {message}"):
        build(sft_config(tmp_path, path))


@pytest.mark.parametrize("name, content, problem", [
    ("bad.jsonl.gz", b"not gzip at all\n", r"cannot be read as JSON lines \(BadGzipFile: Not a gzipped file"),
    ("bad.jsonl.gz", None, r"cannot be read as JSON lines after line \d+ \(EOFError: Compressed file ended"),
    ("bad.jsonl", b'{"prompt": "p", "response": "r"}\n\xff\xfe binary\n',
     r"line 2: not UTF-8 text \(invalid start byte at byte 0 of the line\); is it a binary file\?"),
], ids=["gzip-header", "truncated-gzip", "not-utf8"])
def test_a_file_that_cannot_be_read_is_named(tmp_path, name, content, problem):
    if content is None:  # a gzip cut in the middle of its stream
        lines = "".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) + "\n" for i in range(2000))
        whole = gzip.compress(lines.encode())
        content = whole[:len(whole) // 2]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataFileError, match=rf"^{tmp_path / name}:? {problem}"):
        build(sft_config(tmp_path, tmp_path / name))


def test_a_file_that_is_not_json_lines_is_named(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a record\n")
    with pytest.raises(ValueError) as error:
        build(sft_config(tmp_path, notes))
    assert str(error.value) == (f"data path {str(notes)!r}: {notes} is not a JSON-lines file "
                                "(.jsonl, .json, .jsonl.gz, .json.gz)")


def test_blank_lines_between_records_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "ex.jsonl", [{"prompt": "p", "response": "r"}, "", "  ",
                                                {"prompt": "q", "response": "s"}])
    assert build(sft_config(tmp_path, path))[0].dataset.report.examples == 2


def test_format_sft_needs_files_or_hub():
    with pytest.raises(ValueError, match="data.format=sft .* not 'embedded'"):
        DataConfig(format="sft", source="embedded")
    run = validate(load_config(["data=sft", "data.path=x.jsonl"]))
    assert run.data.format == "sft" and run.data.keep_document_boundaries
    for source, what in (("files", "a JSON-lines file, folder or glob"), ("hub", "the dataset name")):
        with pytest.raises(ValueError) as error:
            build(DataConfig(format="sft", source=source, path=None))
        assert str(error.value) == f"data.format=sft with data.source={source} needs data.path ({what})"


def test_a_validation_fraction_that_holds_out_nothing_is_named(tmp_path):
    path = write_jsonl(tmp_path / "ex.jsonl", example_records([(2, 3), (1, 1), (5, 2), (3, 4)]))
    with pytest.raises(ValueError) as error:
        build(sft_config(tmp_path, path, val_fraction=1e-9))
    assert str(error.value) == ("data.val_fraction=1e-09 holds out none of the 4 examples; raise it or give "
                                "data.val_path")


def test_a_validation_fraction_that_holds_out_every_example_is_named(tmp_path):
    """It said 'none of the 0 examples has a target token left in a window ...; raise data.seq_len'."""
    path = write_jsonl(tmp_path / "ex.jsonl", example_records([(2, 3), (1, 1), (5, 2), (3, 4)]))
    with pytest.raises(ValueError) as error:
        build(sft_config(tmp_path, path, val_fraction=0.9999))
    assert str(error.value) == ("data.val_fraction=0.9999 holds out all 4 examples, leaving none to train "
                                "on; lower it or give data.val_path")


def test_a_record_the_chat_template_refuses_is_named_by_file_and_line(tmp_path):
    chat_tokenizer(tmp_path / "tok", CHATML.replace(
        "{% for", "{% if messages|length == 4 %}{{ raise_exception('four turns') }}{% endif %}{% for", 1))
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    path = write_jsonl(tmp_path / "ex.jsonl", [{"messages": turn}, {"messages": turn * 2}])
    with pytest.raises(ValueError, match=rf"^{path} line 2: the tokenizer's chat template refused the "
                                         "conversation: four turns$"):
        build(sft_config(tmp_path, path, tokenizer=str(tmp_path / "tok")))


# ---- packing ------------------------------------------------------------------------------------
def example_records(lengths):
    """A prompt/response record per (prompt bytes, response bytes)."""
    return [{"prompt": "p" * p, "response": chr(ord("a") + i) * r} for i, (p, r) in enumerate(lengths)]


def plain_length(prompt, response):
    # BOS, "<|user|>\n" prompt EOS, "<|assistant|>\n" response EOS
    return 1 + 9 + prompt + 1 + 14 + response + 1


def test_examples_are_packed_whole_with_document_ids_and_padding_ignored(tmp_path):
    lengths = [(2, 3), (1, 1), (5, 2), (3, 4)]
    sizes = [plain_length(*x) for x in lengths]  # 31, 28, 33, 33
    path = write_jsonl(tmp_path / "ex.jsonl", example_records(lengths))
    train, _ = build(sft_config(tmp_path, path, seq_len=64))
    windows = train.dataset
    # Greedy, in order: 31 + 28 fit in 65 slots, 33 + 33 does not fit, so the last two are alone.
    assert len(windows) == 3 and sum(sizes) == windows.report.tokens
    assert train.report == ("training data: 4 examples (the plain template) in 3 windows of 65 tokens, "
                            "64% filled, 14 target tokens; 0 longer than a window truncated, "
                            "0 without a target dropped")
    batches = list(islice(train, 3))
    first = batches[0]
    # Padding is a document of its own.
    assert first.documents.doc_index[0].tolist() == [0] * 31 + [1] * 28 + [2] * 5
    assert windows[0].doc_ids.dtype == np.int32  # as pretraining's windows give them
    assert windows[1].doc_ids.tolist() == [0] * 33 + [1] * 31  # ids count from each window's first example
    for outside in (-1, 3):
        with pytest.raises(IndexError, match=f"^window {outside} of 3$"):
            windows[outside]
    assert (first.inputs[0, 59:] == EOS).all()
    targets = first.targets[0]
    # Targets: each response and its EOS, never the next example's first token nor padding.
    counted = targets[targets != IGNORE_INDEX].tolist()
    assert counted == [ord("a")] * 3 + [EOS] + [ord("b")] * 1 + [EOS]
    assert targets[30] == IGNORE_INDEX  # the second example's BOS, predicted from the first's EOS
    total = sum((b.targets != IGNORE_INDEX).sum().item() for b in batches)
    assert total == windows.report.targets == sum(r + 1 for _, r in lengths)


def test_overlong_examples_are_truncated_or_dropped_and_counted(tmp_path):
    # Windows of 47 slots: 31 and 46 tokens fit; 60 and 71 do not, and the last one's response
    # starts after its first 47 tokens, so truncation leaves it without a target.
    lengths = [(2, 3), (10, 10), (10, 24), (40, 5)]
    path = write_jsonl(tmp_path / "ex.jsonl", example_records(lengths))
    truncated = build(sft_config(tmp_path, path, seq_len=46))[0]
    report = truncated.dataset.report
    assert (report.truncated, report.dropped_long, report.dropped_no_target) == (1, 0, 1)
    assert "1 longer than a window truncated, 1 without a target dropped" in truncated.report
    # The truncated example keeps the response bytes among its first 47 tokens (no EOS).
    assert report.targets == (3 + 1) + (10 + 1) + (47 - plain_length(10, 0) + 1)

    dropped = build(sft_config(tmp_path, path, seq_len=46, sft_overlong="drop"))[0]
    report = dropped.dataset.report
    assert (report.truncated, report.dropped_long, report.dropped_no_target) == (0, 2, 0)
    assert dropped.report == ("training data: 4 examples (the plain template) in 2 windows of 47 tokens, "
                              "82% filled, 15 target tokens; 2 longer than a window dropped, "
                              "0 without a target dropped")

    with pytest.raises(ValueError, match="none of the 1 examples has a target"):
        build(sft_config(tmp_path, write_jsonl(tmp_path / "one.jsonl", example_records([(40, 5)])),
                         seq_len=46))


def test_a_generation_prompt_is_the_conversation_then_the_assistants_turn_opened(tmp_path):
    words = chat_tokenizer(tmp_path / "tok")
    ids = {word: i for i, word in words.items()}
    messages = [{"role": "user", "content": "what is two"}]
    folder = str(tmp_path / "tok")
    prompt, template = generation_prompt(messages, folder, load_tokenizer(folder))
    assert template == "the tokenizer's chat template"
    assert prompt == [ids[w] for w in ("<|im_start|>", "user", "what", "is", "two", "<|im_end|>",
                                       "<|im_start|>", "assistant")]
    prompt, template = generation_prompt(messages, "byte", ByteTokenizer())
    assert template == "the plain template"
    assert prompt == [BOS, *b"<|user|>\nwhat is two", EOS, *b"<|assistant|>\n"]


@pytest.mark.parametrize("refused", ["== 4", "== 1 and add_generation_prompt",
                                     "== 2 and not add_generation_prompt"])
def test_a_conversation_the_chat_template_refuses_is_named_with_the_templates_reason(tmp_path, refused):
    """The whole conversation, the turns before an assistant's with the generation prompt, or those
    through it: whichever rendering the template refuses, the error names the record."""
    chat_tokenizer(tmp_path / "tok", CHATML.replace(
        "{% for", f"{{% if messages|length {refused} %}}{{{{ raise_exception('no: ' ~ messages|length) }}}}"
        "{% endif %}{% for", 1))
    cfg = DataConfig(format="sft", source="files", tokenizer=str(tmp_path / "tok"))
    encode = make_encoder(cfg, load_tokenizer(cfg.tokenizer))[0]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] * 2
    with pytest.raises(ValueError, match=r"^hand-written: the tokenizer's chat template refused the "
                                         r"conversation: no: \d$"):
        encode(messages, "hand-written")


def test_an_example_of_exactly_a_window_is_kept_whole(tmp_path):
    assert plain_length(10, 11) == 46 + 1  # the slots of a window of seq_len 46
    path = write_jsonl(tmp_path / "ex.jsonl", example_records([(10, 11)]))
    windows = build(sft_config(tmp_path, path, seq_len=46, sft_overlong="drop"))[0].dataset
    report = windows.report
    assert (report.examples, report.dropped_long, report.truncated, report.tokens) == (1, 0, 0, 47)
    assert len(windows) == report.windows == 1


def example(tokens, targets):
    return Example(np.array(tokens, dtype=np.int64), np.array(targets, dtype=bool))


def test_windows_fill_exactly_and_never_target_an_examples_first_token():
    """Examples packed into windows of 8 slots: two of 3 + 5 tokens fill one exactly; an example's
    first token is never a target, though its encoder marked it (a chat template whose assistant
    turn opens the conversation), as it would be predicted from the example before; an example whose
    only target is its second token is kept; those without targets are dropped and counted."""
    examples = [example([1, 2, 3], [1, 1, 1]), example([4, 5, 6, 7, 8], [1, 0, 0, 0, 1]),
                example([9, 9], [0, 0]), example([9, 9, 9], [1, 0, 0]), example([10, 11], [1, 1])]
    windows = SFTWindows(examples, seq_len=7, with_doc_ids=True, overlong=SFTOverlong.truncate, pad_id=0)
    assert len(windows) == windows.report.windows == 2
    assert (windows.report.examples, windows.report.dropped_no_target, windows.report.targets) == (5, 2, 4)
    first, second = windows[0], windows[1]
    assert first.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert first.target_mask.tolist() == [True, True, False, False, False, False, True]  # 2, 3, 8
    assert first.doc_ids.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert second.tokens.tolist() == [10, 11, 0, 0, 0, 0, 0, 0]
    assert second.target_mask.tolist() == [True] + [False] * 6
    assert windows.describe("training", "a template", SFTOverlong.truncate) == (
        "training data: 5 examples (a template) in 2 windows of 8 tokens, 62% filled, 4 target tokens; "
        "0 longer than a window truncated, 2 without a target dropped")


def test_max_documents_reads_the_first_records_only(tmp_path):
    path = write_jsonl(tmp_path / "ex.jsonl", example_records([(2, 3), (1, 1), (5, 2), (3, 4)]))
    train, _ = build(sft_config(tmp_path, path, max_documents=2))
    assert train.dataset.report.examples == 2
    assert train.dataset.tokens.tolist()[-2:] == [ord("b"), EOS]  # the second record ends the data


# ---- splits, sources, the loader --------------------------------------------------------------
def test_validation_by_fraction_or_path_and_gzip(tmp_path):
    records = example_records([(i % 7, 1 + i % 5) for i in range(40)])
    path = write_jsonl(tmp_path / "ex.jsonl", records)
    train, val = build(sft_config(tmp_path, path, val_fraction=0.25))
    assert train.dataset.report.examples + val.dataset.report.examples == 40
    assert 0 < val.dataset.report.examples < 20  # held out by content (test_held_out_split.py)
    packed = tmp_path / "val.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records[:5]))
    train, val = build(sft_config(tmp_path, path, val_path=str(packed)))
    assert (train.dataset.report.examples, val.dataset.report.examples) == (40, 5)
    assert val.report.startswith("validation data: 5 examples (the plain template)")
    assert val.report.endswith("; 1 longer than a window truncated, 0 without a target dropped")


def test_hub_datasets_go_through_the_datasets_loader(tmp_path):
    # load_dataset(<folder>) reads a local dataset repository as it would one from the Hub.
    repo = tmp_path / "repo"
    repo.mkdir()
    write_jsonl(repo / "train.jsonl", [{"messages": CONVERSATION}] * 3)
    train, _ = build(sft_config(tmp_path, str(repo), source="hub", split="train", seq_len=128,
                                cache_dir=str(tmp_path / "cache")))
    one = SFTWindows([plain()(CONVERSATION, "x")], 128, True, "truncate", EOS)
    assert train.dataset.report.examples == 3
    assert (train.dataset[0].tokens[:len(one.tokens)] == one.tokens).all()
    bad = tmp_path / "bad"
    bad.mkdir()
    unknown_role = {"messages": [{"role": "x", "content": ""}]}
    write_jsonl(bad / "train.jsonl", [{"messages": CONVERSATION}, unknown_role])
    with pytest.raises(ValueError, match=r"\[train\] row 1: message 0 has the unknown role 'x'"):
        build(sft_config(tmp_path, str(bad), source="hub", cache_dir=str(tmp_path / "cache")))


@pytest.mark.parametrize("streaming", [False, True])
def test_a_hub_datasets_validation_is_its_val_split_or_held_out_of_its_training_split(
        tmp_path, monkeypatch, streaming):
    """data.val_split reads that split of the configuration asked for, in the mode asked for and
    into data.cache_dir (nothing in the default cache); data.max_documents and data.val_fraction
    apply to the training split."""
    repo = tmp_path / "repo"  # configurations a (the default) and b, each with train and test splits
    records = {("a", "train"): [{"prompt": "a", "response": "A"}] * 2,
               ("a", "test"): [{"prompt": "a", "response": "A"}],
               ("b", "train"): [{"prompt": f"question {i}", "response": "B" * (i + 1)} for i in range(40)],
               ("b", "test"): [{"prompt": "held", "response": "out"}] * 3}
    readme = ["---", "configs:"]
    for config in ("a", "b"):
        readme += [f"- config_name: {config}", "  data_files:"]
        for split in ("train", "test"):
            (repo / config).mkdir(parents=True, exist_ok=True)
            write_jsonl(repo / config / f"{split}.jsonl", records[config, split])
            readme += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
        readme += ["  default: true"] if config == "a" else []
    (repo / "README.md").write_text("\n".join([*readme, "---", ""]))
    default_cache = tmp_path / "default-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", default_cache)
    cache = tmp_path / "cache"
    hub = dict(source="hub", name="b", split="train", seq_len=128, streaming=streaming, cache_dir=str(cache))
    train, val = build(sft_config(tmp_path, str(repo), val_split="test", max_documents=30, **hub))
    assert (train.dataset.report.examples, val.dataset.report.examples) == (30, 3)
    test_record = plain()(to_messages(records["b", "test"][0], "x"), "x").tokens
    assert val.dataset[0].tokens[:len(test_record)].tolist() == test_record.tolist()
    assert bool(list(cache.rglob("*.arrow"))) is not streaming and not default_cache.exists()

    train, val = build(sft_config(tmp_path, str(repo), val_fraction=0.25, max_documents=30, **hub))
    assert train.dataset.report.examples + val.dataset.report.examples == 30
    assert 0 < val.dataset.report.examples < 15


@pytest.mark.parametrize("streaming", [False, True])
def test_a_hub_dataset_is_read_in_the_config_and_mode_asked_for_into_its_cache(tmp_path, streaming):
    repo = tmp_path / "repo"  # two configurations, the first the default
    configs = {"a": [{"prompt": "a", "response": "A"}], "b": [{"messages": CONVERSATION}] * 2}
    for config, records in configs.items():
        (repo / config).mkdir(parents=True)
        write_jsonl(repo / config / "train.jsonl", records)
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: a\n  data_files: a/*.jsonl\n"
                                    "  default: true\n- config_name: b\n  data_files: b/*.jsonl\n---\n")
    cache = tmp_path / "cache"
    train, _ = build(sft_config(tmp_path, str(repo), source="hub", name="b", split="train", seq_len=128,
                                streaming=streaming, cache_dir=str(cache)))
    assert train.dataset.report.examples == 2
    # A stream is read as it goes; otherwise the split is prepared once, as Arrow files in the cache.
    assert bool(list(cache.rglob("*.arrow"))) is not streaming


def test_ranks_split_the_windows_and_resume_continues_exactly(tmp_path):
    path = write_jsonl(tmp_path / "ex.jsonl", example_records([(i % 9, 1 + i % 13) for i in range(60)]))
    cfg = sft_config(tmp_path, path, shuffle=True)
    single = build(cfg, batch_size=4)[0]
    assert len(single.dataset) >= 12
    whole = [b.inputs for b in islice(single, 3)]
    ranks = [build(cfg, batch_size=2, rank=r, world_size=2)[0] for r in (0, 1)]
    per_rank = [[b.inputs for b in islice(loader, 3)] for loader in ranks]
    for step in range(3):
        assert torch.equal(torch.cat([per_rank[0][step], per_rank[1][step]]), whole[step])

    resumed = build(cfg, batch_size=4)[0]
    first = build(cfg, batch_size=4)[0]
    list(islice(first, 2))
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(next(iter(resumed)).inputs, whole[2])


def test_masked_targets_agree_with_the_examples(tmp_path):
    """Every counted target is the token the example holds next, and the mask is the template's."""
    path = write_jsonl(tmp_path / "ex.jsonl", [{"messages": CONVERSATION}] * 2)
    train, _ = build(sft_config(tmp_path, path, seq_len=128))
    batch = next(iter(train))
    example = plain()(CONVERSATION, "x")
    n = len(example.tokens)
    expected = np.where(example.is_target[1:], example.tokens[1:], IGNORE_INDEX)
    assert batch.targets[0, :n - 1].tolist() == expected.tolist()
