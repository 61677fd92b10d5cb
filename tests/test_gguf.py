"""Any supported GGUF file loads into the decoder and computes what llama.cpp computes.

Small files are written here with ``gguf.GGUFWriter`` (random weights, each supported
architecture and tensor type), loaded with :func:`flsmem.models.gguf.load`, and their
logits compared with :mod:`bench.gguf_reference`, a plain numpy forward pass that reads
the same dequantised tensors in llama.cpp's own layout; SentencePiece vocabularies are
tokenized as llama.cpp's algorithm there tokenizes them.
"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the real-model extra is not installed: pip install -e '.[real]'")
pytest.importorskip("tokenizers", reason="the real-model extra is not installed: pip install -e '.[real]'")

from bench.gguf_reference import reference_logits, reference_tokens  # noqa: E402
from flsmem.models import gguf as loader  # noqa: E402

T = gguf.GGMLQuantizationType
# Quantised rows must hold whole blocks (256 values for the K-quants).
WIDTH, HEADS, KV_HEADS, HIDDEN, LAYERS, VOCAB = 256, 4, 2, 256, 2, 256
HEAD_DIM = WIDTH // HEADS
# Gemma 3 has one global layer in six; a window shorter than the test's text.
GEMMA_LAYERS, GEMMA_WINDOW = 6, 4


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small Gemma-like vocabulary: control tokens, user-defined newline runs, the 256
    byte tokens, single characters, and scored merges (some that only a lower-scored
    intermediate piece can reach)."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
    user = ["\n", "\n\n", "  "]
    chars = list("\u2581abcdefghijklmnopqrstuvwxyzAPSé,.:!'1870")
    merged = ["er", "on", "\u2581A", "nn", "nne", "Anne", "\u2581Anne", "\u2581P", "ers", "\u2581Pers", "ua", "si",
              "sion", "uasion", "\u2581Persuasion", "18", "17", "1817", "\u2581s", "\u2581sa", "id", "\u2581said",
              "th", "\u2581th", "he", "\u2581the", "ll", "\u2581w", "\u2581we", "\u2581well", "\u2581\u2581"]
    tokens = control + user + [f"<0x{b:02X}>" for b in range(256)] + chars + merged
    scores = ([0.0] * (len(control) + len(user) + 256) + [-100.0 - i for i in range(len(chars))]
              + [-float(len(m)) - 0.01 * i for i, m in enumerate(merged)])
    kinds = [3] * len(control) + [4] * len(user) + [6] * 256 + [1] * (len(chars) + len(merged))
    return tokens, scores, kinds


def _k_quant_blocks(rng, rows: int, cols: int, kind) -> np.ndarray:
    """Random valid Q4_K / Q6_K blocks: random quants, with each block's float16 scales
    small and finite and its sub-block scales small, so the weights are of the size a
    trained model has (random bits could make a scale NaN or a weight huge)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = lambda n, low, high: rng.uniform(low, high, (rows, cols // block, n)).astype(np.float16).view(np.uint8)  # noqa: E731
    if kind == T.Q4_K:  # d, dmin (float16), 12 bytes of 6-bit sub-block scales and mins, quants
        data[..., 0:4] = scale(2, 1e-4, 1e-3)
    else:  # quants (192 bytes), 16 int8 sub-block scales, d (float16)
        data[..., 192:208] = rng.integers(1, 5, (rows, cols // block, 16), dtype=np.int8).view(np.uint8)
        data[..., 208:210] = scale(1, 1e-3, 5e-3)
    return data.reshape(rows, -1)


def _add(writer, rng, name, value, kind):
    """One tensor of numpy shape ``value.shape`` in the file as ``kind``."""
    if value.ndim == 1 or kind == T.F32:
        writer.add_tensor(name, value.astype(np.float32))
    elif kind == T.F16:
        writer.add_tensor(name, value.astype(np.float16))
    elif kind in (T.Q4_K, T.Q6_K):
        writer.add_tensor(name, _k_quant_blocks(rng, *value.shape, kind), raw_dtype=kind)
    else:
        # Quantised data is bytes; the writer derives the tensor's shape from them.
        writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), kind), raw_dtype=kind)


def _write(path, arch, kind, *, tied=True, bias=False, factors=False, space_prefix=False, seed=0):
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    gemma = arch == "gemma3"
    layers = GEMMA_LAYERS if gemma else LAYERS
    writer.add_context_length(512)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    writer.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    if gemma:
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_sliding_window(GEMMA_WINDOW)
        tokens, scores, kinds = _sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(kinds)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(space_prefix)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default" if arch == "llama" else "qwen2")
        writer.add_token_list(_bytes_to_unicode())
        writer.add_token_merges([])
        writer.add_token_types([1] * VOCAB)
    vocab = len(tokens) if gemma else VOCAB
    weight = lambda *shape: rng.normal(0, 0.05, shape).astype(np.float32)  # noqa: E731
    norm = lambda width=WIDTH: (1 + rng.normal(0, 0.1, width)).astype(np.float32)  # noqa: E731
    _add(writer, rng, "token_embd.weight", weight(vocab, WIDTH), kind)
    for i in range(layers):
        p = f"blk.{i}."
        _add(writer, rng, p + "attn_norm.weight", norm(), kind)
        for name, rows in (("attn_q", WIDTH), ("attn_k", KV_HEADS * HEAD_DIM), ("attn_v", KV_HEADS * HEAD_DIM)):
            _add(writer, rng, p + name + ".weight", weight(rows, WIDTH), kind)
            if bias:
                _add(writer, rng, p + name + ".bias", weight(rows), kind)
        _add(writer, rng, p + "attn_output.weight", weight(WIDTH, WIDTH), kind)
        _add(writer, rng, p + "ffn_norm.weight", norm(), kind)
        _add(writer, rng, p + "ffn_gate.weight", weight(HIDDEN, WIDTH), kind)
        _add(writer, rng, p + "ffn_up.weight", weight(HIDDEN, WIDTH), kind)
        _add(writer, rng, p + "ffn_down.weight", weight(WIDTH, HIDDEN), kind)
        if gemma:
            for name, width in (("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM), ("post_attention_norm", WIDTH),
                                ("post_ffw_norm", WIDTH)):
                _add(writer, rng, p + name + ".weight", norm(width), kind)
    _add(writer, rng, "output_norm.weight", norm(), kind)
    if not tied:
        _add(writer, rng, "output.weight", weight(vocab, WIDTH), kind)
    if factors:
        writer.add_tensor("rope_freqs.weight", rng.uniform(1.0, 8.0, HEAD_DIM // 2).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CASES = [
    ("llama", T.F32, {}),
    ("llama", T.F16, {"tied": False}),
    ("llama", T.BF16, {"factors": True}),
    ("llama", T.Q8_0, {}),
    ("llama", T.Q4_0, {}),
    ("llama", T.Q4_1, {}),
    ("llama", T.Q5_0, {}),
    ("qwen2", T.Q4_K, {"bias": True}),
    ("qwen2", T.Q6_K, {"bias": True, "tied": False}),
    ("gemma3", T.Q5_0, {}),
    ("gemma3", T.Q4_K, {}),
]


@pytest.mark.parametrize("arch, kind, options", CASES, ids=[f"{a}-{k.name}" for a, k, _ in CASES])
def test_gguf_matches_llama_cpp_in_numpy(tmp_path, arch, kind, options):
    path = tmp_path / "model.gguf"
    _write(path, arch, kind, **options)
    model, tokenizer = loader.load(path)
    tokens = tokenizer.encode("Persuasion, 1817: Anne!")
    assert tokenizer.decode(tokens) == "Persuasion, 1817: Anne!"
    if arch == "gemma3":  # BOS first, and longer than the window, so the local layers forget
        tokens = np.concatenate([[tokenizer.bos_id], tokens])
        assert tokenizer.add_bos and len(tokens) > 2 * GEMMA_WINDOW and model.cfg.local_layers == (0, 1, 2, 3, 4)
    got = np.asarray(model(tokens[None])[0][0], np.float64)
    want = reference_logits(path, tokens)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert model.cfg.qkv_bias == options.get("bias", False)
    assert model.cfg.tie_embeddings == options.get("tied", True)


TEXTS = ["Persuasion, 1817: Anne!", " Anne said well,\n\nthe  Persuasion.", "Ann\u00e9e \u2603 \u65e5\u672c\n\n\nAnne",
         "<start_of_turn>the\tAnnnne  <bos>!", "", "   ", "Persuasionsion 18171817"]


@pytest.mark.parametrize("space_prefix", [False, True], ids=["gemma", "llama2-space-prefix"])
def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp(tmp_path, space_prefix):
    """Score-greedy merges, byte fallback for unknown characters (the snowman, the
    kanji, the tab), user-defined and control tokens matched whole; with Llama 2's
    space prefix, a space before the text and after each literal token."""
    path = tmp_path / "model.gguf"
    _write(path, "gemma3", T.F32, space_prefix=space_prefix)
    from flsmem.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(gguf.GGUFReader(path))
    rng = np.random.default_rng(0)
    pieces = ["Anne", "Persuasion", " ", "  ", "\n", "the", "well", "1817", "\u00e9", "\u2603", "er", "sion", "!"]
    texts = TEXTS + ["".join(rng.choice(pieces, 12)) for _ in range(40)]
    for text in texts:
        assert tokenizer.encode(text).tolist() == reference_tokens(path, text), text
        # The space put after a literal token is decoded too, as llama.cpp decodes it.
        if not space_prefix:
            assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode(TEXTS[0])) == TEXTS[0]
    snowman = ["<0xE2>", "<0x98>", "<0x83>"]
    assert [tokenizer.token(i) for i in tokenizer.encode("\u2603")] == (["\u2581"] if space_prefix else []) + snowman


def test_unsupported_files_are_refused_by_name(tmp_path):
    path = tmp_path / "model.gguf"
    _write(path, "llama", T.Q5_1)
    with pytest.raises(ValueError, match=r"type Q5_1, which is not supported; supported: F32, F16, BF16"):
        loader.load(path)
    other = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(other), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'phi3' is not supported; supported: llama, qwen2, gemma3"):
        loader.load(other)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        loader.load(text)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        loader.load(tmp_path / "missing.gguf")
