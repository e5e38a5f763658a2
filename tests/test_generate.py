"""Generation with the eager Llama: greedy tokens as transformers', the KV cache as the full
forward, seeded sampling, and scripts/generate.py on a training checkpoint and an HF export."""

import importlib.util
from pathlib import Path

import pytest
import torch
from test_sft import chat_tokenizer

from codatrain.config import load_config
from codatrain.data.tokenizer import ByteTokenizer, load_tokenizer
from codatrain.kernels.attention import documents_from_ids
from codatrain.model import Llama, LlamaConfig
from codatrain.model.generate import generate, next_token
from codatrain.model.hf import save_hf
from codatrain.model.llama import KVCache
from codatrain.train.trainer import train

# Default RoPE and an untied head.
CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=258, max_seq_len=64)
# Llama 3.2's RoPE scaling and tied head; generation runs far past the pretraining context of 8.
LLAMA3_TIED = CFG.replace(rope_type="llama3", rope_factor=32.0, rope_original_max_positions=8,
                          tie_embeddings=True)


def tiny_model(seed: int = 0, cfg: LlamaConfig = CFG) -> Llama:
    model = Llama(cfg)
    model.init_weights(seed)
    return model.eval()


def prompts(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))


def save_word_tokenizer(folder: Path) -> None:
    """A four-word tokenizer.json with an end-of-text token."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.add_special_tokens(["</s>"])
    words.save(str(folder / "tokenizer.json"))


def load_script():
    script = Path(__file__).resolve().parent.parent / "scripts" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_script", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cfg", [CFG, LLAMA3_TIED], ids=["default-rope-untied", "llama3-rope-tied"])
def test_greedy_tokens_equal_transformers_generate(tmp_path, cfg):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(cfg=cfg)
    save_hf(tmp_path, cfg, model.state_dict().items())
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    tokens = prompts()
    expected = hf.generate(
        tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=20, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    assert torch.equal(generate(model, tokens, 20), expected)


def test_cached_generation_equals_recomputing_the_whole_sequence():
    model, tokens = tiny_model(), prompts()
    greedy = generate(model, tokens, 30)
    assert torch.equal(greedy, generate(model, tokens, 30, use_cache=False))
    sampled = [
        generate(model, tokens, 30, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(3),
                 use_cache=cache)
        for cache in (True, False)
    ]
    assert torch.equal(*sampled)


def test_cached_logits_match_the_full_forward():
    model, tokens = tiny_model(), prompts(length=12)
    cache = KVCache(CFG, 2, 12, "cpu", torch.float32)
    with torch.no_grad():
        full = model(tokens)
        stepped = torch.cat([model(tokens[:, :7], cache=cache), model(tokens[:, 7:9], cache=cache),
                             *(model(tokens[:, i:i + 1], cache=cache) for i in range(9, 12))], dim=1)
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache(CFG, 1, CFG.max_seq_len + 1, "cpu", torch.float32)


def test_decoding_with_a_cache_reaches_exactly_max_seq_len_positions():
    """The length bound counts the cached positions: a full cache takes no further token."""
    cfg = CFG.replace(max_seq_len=8)
    model, tokens = tiny_model(cfg=cfg), prompts(length=9)
    cache = KVCache(cfg, 2, cfg.max_seq_len, "cpu", torch.float32)
    with torch.no_grad():
        model(tokens[:, :5], cache=cache)
        with pytest.raises(ValueError, match=r"^sequence length 9 exceeds model.max_seq_len=8$"):
            model(tokens[:, 5:], cache=cache)  # 5 cached + 4; refused before the cache changes
        stepped = [model(tokens[:, i:i + 1], cache=cache) for i in range(5, 8)]
        assert cache.length == 8 == cfg.max_seq_len
        torch.testing.assert_close(stepped[-1][:, -1], model(tokens[:, :8])[:, -1], rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"^sequence length 9 exceeds model.max_seq_len=8$"):
            model(tokens[:, :1], cache=cache)


def test_a_cache_may_hold_max_seq_len_positions_in_the_dtype_and_on_the_device_asked_for():
    cache = KVCache(CFG, 2, CFG.max_seq_len, "meta", torch.bfloat16)
    assert len(cache.layers) == CFG.n_layers
    for layer in cache.layers:
        for buffer in (layer.keys, layer.values):
            assert buffer.shape == (2, CFG.n_kv_heads, CFG.max_seq_len, CFG.head_dim)
            assert buffer.device.type == "meta" and buffer.dtype == torch.bfloat16


def test_forward_and_decoding_make_every_tensor_on_the_device_of_the_tokens():
    """On the meta device (a stand-in for a GPU on this CPU-only suite) any position, mask or RoPE
    table made on the CPU would meet a meta tensor and fail."""
    with torch.device("meta"):
        model = Llama(CFG)
    tokens = torch.zeros(2, 5, dtype=torch.long, device="meta")
    assert model(tokens).device.type == "meta"
    cache = KVCache(CFG, 2, 8, "meta", torch.float32)
    assert model(tokens, cache=cache).device.type == "meta"
    assert model(tokens[:, :1], cache=cache).shape == (2, 1, CFG.vocab_size)


def test_a_cache_cannot_be_combined_with_documents():
    with torch.device("meta"):
        model = Llama(CFG)
    tokens = torch.zeros(1, 4, dtype=torch.long, device="meta")
    cache = KVCache(CFG, 1, 8, "meta", torch.float32)
    message = "^a KV cache decodes one document per row; documents cannot be combined with it$"
    with pytest.raises(ValueError, match=message):
        model(tokens, doc_ids=torch.zeros_like(tokens), cache=cache)
    with pytest.raises(ValueError, match=message):
        model(tokens, cache=cache, documents=documents_from_ids(torch.zeros(1, 4, dtype=torch.long)))


def test_sampling_is_reproducible_from_the_seed_and_top_p_zero_is_greedy():
    model, tokens = tiny_model(), prompts()

    def sample(seed: int, **options) -> torch.Tensor:
        return generate(model, tokens, 25, generator=torch.Generator().manual_seed(seed), **options)

    hot = {"temperature": 1.5, "top_p": 0.95}
    assert torch.equal(sample(7, **hot), sample(7, **hot))
    assert not torch.equal(sample(7, **hot), sample(8, **hot))
    assert torch.equal(sample(7, temperature=1.5, top_p=0.0), generate(model, tokens, 25))


def test_top_p_keeps_the_smallest_set_that_reaches_the_mass():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    drawn = next_token(logits, 1.0, 0.7, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == {0, 1}  # 0.5 < 0.7 ≤ 0.5 + 0.3
    assert 0.55 < (drawn == 0).float().mean() < 0.70  # renormalised: 0.5 / 0.8 = 0.625


def test_generation_stops_once_every_row_produced_eos():
    model, tokens = tiny_model(), prompts()
    greedy = generate(model, tokens, 10)
    new = greedy[:, 5:]
    for eos in (int(new[0, 2]), int(new[1, 4])):  # one row's third or fifth token as the EOS
        # Each row is greedy up to its first EOS and EOS after it; it stops when both rows are done.
        first = [(row == eos).nonzero()[0].item() if (row == eos).any() else len(row) for row in new]
        expected = new.clone()
        for row, end in enumerate(first):
            expected[row, end:] = eos
        expected = expected[:, :max(first) + 1]
        assert torch.equal(generate(model, tokens, 10, eos_id=eos), torch.cat([tokens, expected], dim=1))


def test_script_on_a_training_checkpoint_and_its_hf_export(tmp_path, capsys):
    script = load_script()
    train(load_config([
        "train.log_every=1", "train.val_every=0", "train.progress=false", "data=synthetic",
        "data.num_workers=0", "data.seq_len=32", "train.micro_batch_size=2", "train.tokens_per_step=64",
        "train.steps=2", f"train.run_dir={tmp_path / 'run'}",
    ]))
    capsys.readouterr()  # the run's log
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    argv = ["--prompt", "The ", "--max-new-tokens", "12", "--device", "cpu"]
    assert script.main([str(checkpoint), *argv]) == 0
    from_checkpoint = capsys.readouterr().out
    assert from_checkpoint.startswith("The ")

    # The same greedy text through the package, and from the checkpoint's HF export.
    model = script.load_model(str(checkpoint), "cpu")
    tokenizer = ByteTokenizer()
    prompt = torch.tensor([[tokenizer.bos_id, *tokenizer.encode_batch(["The "])[0].tolist()]])
    tokens = generate(model, prompt, 12, eos_id=tokenizer.eos_id)
    assert from_checkpoint == tokenizer.decode(tokens[0].tolist()) + "\n"
    export = tmp_path / "export"
    save_hf(export, model.cfg, model.state_dict().items())
    assert script.main([str(export), *argv]) == 0
    assert capsys.readouterr().out == from_checkpoint

    sampled = [script.main([str(export), *argv, "--temperature", "1", "--seed", "5"]) for _ in range(2)]
    assert sampled == [0, 0]
    first, second = capsys.readouterr().out.splitlines(keepends=True)[-2:]
    assert first == second

    # A folder's own tokenizer is used unless --tokenizer names another.
    save_word_tokenizer(export)
    assert script.main([str(export), *argv, "--tokenizer", "byte"]) == 0
    assert capsys.readouterr().out == from_checkpoint
    assert script.main([str(export), "--prompt", "hello world", "--max-new-tokens", "3"]) == 0
    words = load_tokenizer(str(export))
    tokens = generate(model, torch.tensor([[1, 2]]), 3, eos_id=words.eos_id)  # "hello world", no BOS
    out = capsys.readouterr().out
    assert out == words.decode(tokens[0].tolist()) + "\n" and out.startswith("hello world")

    assert script.main([str(tmp_path / "missing"), *argv]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing'}: no such file or directory\n"
    # The run directory for one of its checkpoints: named as such, with the newest.
    assert script.main([str(tmp_path / "run"), *argv]) == 1
    assert f"holds checkpoints: pass one, e.g. the newest, {checkpoint}\n" in capsys.readouterr().err


def test_tokenizers_decode_what_they_encode(tmp_path):
    byte = ByteTokenizer()
    ids = byte.encode_batch(["héllo"])[0].tolist()
    assert byte.decode([byte.bos_id, *ids, byte.eos_id, 300]) == "héllo"  # delimiters and non-bytes dropped
    save_word_tokenizer(tmp_path)
    hf = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert hf.decode([*hf.encode_batch(["hello world"])[0].tolist(), hf.eos_id]) == "hello world"


def test_chat_renders_the_prompt_as_fine_tuning_does_and_prints_the_reply(tmp_path, capsys):
    script = load_script()
    model = tiny_model()
    save_hf(tmp_path / "chat", CFG, model.state_dict().items())
    words = chat_tokenizer(tmp_path / "chat")  # a chat template: <|im_start|>role content<|im_end|>
    save_hf(tmp_path / "plain", CFG, model.state_dict().items())  # no tokenizer: bytes, the plain template
    ids = {word: i for i, word in words.items()}
    chat = [ids[w] for w in ("<|im_start|>", "user", "what", "is", "two", "<|im_end|>", "<|im_start|>",
                             "assistant")]
    byte = ByteTokenizer()
    plain = [byte.bos_id, *b"<|user|>\nwhat is two", byte.eos_id, *b"<|assistant|>\n"]
    cases = [(tmp_path / "chat", chat, load_tokenizer(str(tmp_path / "chat")),
              "the tokenizer's chat template"), (tmp_path / "plain", plain, byte, "the plain template")]
    for folder, prompt, tokenizer, template in cases:
        assert script.main([str(folder), "--chat", "--prompt", "what is two", "--max-new-tokens", "5",
                            "--device", "cpu"]) == 0
        out, err = capsys.readouterr()
        assert f"tokenizer: {folder if tokenizer is not byte else 'byte'}, {template}" in err
        tokens = generate(model, torch.tensor([prompt]), 5, eos_id=tokenizer.eos_id)[0].tolist()
        assert out == tokenizer.decode(tokens[len(prompt):]) + "\n"


def test_a_device_this_machine_lacks_is_one_line(tmp_path, capsys, monkeypatch):
    script = load_script()
    save_hf(tmp_path, CFG, tiny_model().state_dict().items())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main([str(tmp_path), "--device", "cuda"]) == 1
    assert capsys.readouterr().err == ("error: --device cuda: no CUDA device is available here; use --device "
                                       "cpu\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert script.main([str(tmp_path), "--device", "cuda:2"]) == 1
    assert capsys.readouterr().err == ("error: --device cuda:2: this machine has 2 CUDA device(s), cuda:0 to "
                                       "cuda:1\n")


@pytest.mark.parametrize("option, value, message", [
    ("--max-new-tokens", "-1", "argument --max-new-tokens: must be 0 or more, got -1"),
    ("--temperature", "-1", "argument --temperature: must be 0 (greedy) or positive, got -1.0"),
    ("--temperature", "nan", "argument --temperature: must be 0 (greedy) or positive, got nan"),
    ("--top-p", "1.5", "argument --top-p: must be in [0, 1], got 1.5"),
])
def test_sampling_settings_it_cannot_use_are_a_usage_error(tmp_path, capsys, option, value, message):
    script = load_script()
    with pytest.raises(SystemExit) as exit_:
        script.main([str(tmp_path / "not-loaded"), option, value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f" error: {message}\n")


def test_a_reply_past_the_models_max_seq_len_is_one_line_naming_the_most_new_tokens(tmp_path, capsys):
    # It was generate()'s ValueError about the KV cache's capacity, as a traceback.
    script = load_script()
    save_hf(tmp_path, CFG, tiny_model().state_dict().items())  # max_seq_len 64
    argv = [str(tmp_path), "--prompt", "hi", "--device", "cpu"]  # BOS and two bytes
    assert script.main([*argv, "--max-new-tokens", "62"]) == 1
    assert capsys.readouterr().err.endswith(
        "error: the prompt's 3 tokens and --max-new-tokens 62 need 65 positions, more than the model's "
        "max_seq_len=64; ask for --max-new-tokens 61 at most\n")
    assert script.main([*argv, "--max-new-tokens", "61"]) == 0


def test_an_empty_prompt_without_a_bos_token_is_one_line(tmp_path, capsys):
    # The default --prompt "" with a tokenizer without BOS (Qwen's) gave the model an empty batch:
    # torch's embedding error as a traceback.
    script = load_script()
    save_hf(tmp_path, CFG, tiny_model().state_dict().items())
    save_word_tokenizer(tmp_path)  # </s> only
    assert script.main([str(tmp_path), "--max-new-tokens", "3", "--device", "cpu"]) == 1
    assert capsys.readouterr().err == (f"error: tokenizer {tmp_path} has no BOS token to start from, so an "
                                       "empty prompt leaves nothing to continue; give --prompt\n")


def test_a_tokenizer_out_of_reach_is_named_by_its_option(tmp_path, capsys):
    script = load_script()
    save_hf(tmp_path, CFG, tiny_model().state_dict().items())
    missing = tmp_path / "tok.json"
    assert script.main([str(tmp_path), "--tokenizer", str(missing)]) == 1
    assert capsys.readouterr().err == f"error: tokenizer '{missing}' (--tokenizer) does not exist\n"


def test_a_tokenizer_with_more_ids_than_the_model_is_one_line(tmp_path, capsys):
    # As training refuses it: its ids past the embedding were an IndexError traceback, or (for a
    # prompt of low ids) a reply decoded with the wrong tokenizer, without a word.
    tokenizers = pytest.importorskip("tokenizers")
    script = load_script()
    save_hf(tmp_path / "hf", CFG, tiny_model().state_dict().items())  # vocab_size 258
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3, **{f"w{i}": 4 + i for i in range(296)}}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.add_special_tokens(["</s>"])
    words.save(str(tmp_path / "big.json"))
    argv = ["--tokenizer", str(tmp_path / "big.json"), "--prompt", "hello", "--max-new-tokens", "3"]
    assert script.main([str(tmp_path / "hf"), *argv]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: tokenizer {tmp_path / 'big.json'} (--tokenizer) has 300 token ids, more than "
        "model.vocab_size=258; use the tokenizer the model was trained with"
    )
