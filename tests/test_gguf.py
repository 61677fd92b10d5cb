"""Any Llama-family GGUF file loads into the decoder and computes what llama.cpp computes.

Small files are written here with ``gguf.GGUFWriter`` (random weights, each supported
architecture and tensor type), loaded with :func:`flsmem.models.gguf.load`, and their
logits compared with a plain numpy forward pass that reads the same dequantised
tensors in llama.cpp's own layout: adjacent-pair rotation on the permuted Q/K rows for
``llama``, half-split rotation for ``qwen2``.
"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the real-model extra is not installed: pip install -e '.[real]'")
pytest.importorskip("tokenizers", reason="the real-model extra is not installed: pip install -e '.[real]'")

from flsmem.models import gguf as loader  # noqa: E402

T = gguf.GGMLQuantizationType
# Quantised rows must hold whole blocks (256 values for the K-quants).
WIDTH, HEADS, KV_HEADS, HIDDEN, LAYERS, VOCAB = 256, 4, 2, 256, 2, 256
HEAD_DIM = WIDTH // HEADS


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


def _write(path, arch, kind, *, tied=True, bias=False, factors=False, seed=0):
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(512)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(HIDDEN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    writer.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default" if arch == "llama" else "qwen2")
    writer.add_token_list(_bytes_to_unicode())
    writer.add_token_merges([])
    writer.add_token_types([1] * VOCAB)
    weight = lambda *shape: rng.normal(0, 0.05, shape).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + rng.normal(0, 0.1, WIDTH)).astype(np.float32)  # noqa: E731
    _add(writer, rng, "token_embd.weight", weight(VOCAB, WIDTH), kind)
    for i in range(LAYERS):
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
    _add(writer, rng, "output_norm.weight", norm(), kind)
    if not tied:
        _add(writer, rng, "output.weight", weight(VOCAB, WIDTH), kind)
    if factors:
        writer.add_tensor("rope_freqs.weight", rng.uniform(1.0, 8.0, HEAD_DIM // 2).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference_logits(path, tokens) -> np.ndarray:
    """llama.cpp's computation in numpy, on the file's dequantised tensors as stored."""
    reader = gguf.GGUFReader(path)
    w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    eps = reader.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents()
    theta = reader.fields[f"{arch}.rope.freq_base"].contents()
    n = len(tokens)

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    freq = theta ** (-np.arange(HEAD_DIM // 2) * 2.0 / HEAD_DIM) / w.get("rope_freqs.weight", 1.0)
    angle = np.arange(n)[:, None, None] * freq[None, None, :]  # [T, 1, D/2]

    def rotate(x):  # [T, heads, D]
        if arch == "llama":  # adjacent pairs (2i, 2i + 1)
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)
            return out
        a, b = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]  # half-split pairs (i, i + D/2)
        return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)

    x = w["token_embd.weight"][tokens]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(LAYERS):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        proj = lambda name: h @ w[p + name + ".weight"].T + w.get(p + name + ".bias", 0.0)  # noqa: E731
        q = rotate(proj("attn_q").reshape(n, HEADS, HEAD_DIM))
        k = rotate(proj("attn_k").reshape(n, KV_HEADS, HEAD_DIM))
        v = proj("attn_v").reshape(n, KV_HEADS, HEAD_DIM)
        k, v = (np.repeat(a, HEADS // KV_HEADS, axis=1) for a in (k, v))  # head h reads KV head h // G
        logits = np.einsum("thd,shd->hts", q, k) / np.sqrt(HEAD_DIM)
        logits = np.where(causal, logits, -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", probs, v).reshape(n, WIDTH) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    x = rms(x, w["output_norm.weight"])
    return x @ w.get("output.weight", w["token_embd.weight"]).T


CASES = [
    ("llama", T.F32, {}),
    ("llama", T.F16, {"tied": False}),
    ("llama", T.BF16, {"factors": True}),
    ("llama", T.Q8_0, {}),
    ("llama", T.Q4_0, {}),
    ("llama", T.Q4_1, {}),
    ("qwen2", T.Q4_K, {"bias": True}),
    ("qwen2", T.Q6_K, {"bias": True, "tied": False}),
]


@pytest.mark.parametrize("arch, kind, options", CASES, ids=[f"{a}-{k.name}" for a, k, _ in CASES])
def test_gguf_matches_llama_cpp_in_numpy(tmp_path, arch, kind, options):
    path = tmp_path / "model.gguf"
    _write(path, arch, kind, **options)
    model, tokenizer = loader.load(path)
    tokens = tokenizer.encode("Persuasion, 1817: Anne!")
    assert tokenizer.decode(tokens) == "Persuasion, 1817: Anne!"
    got = np.asarray(model(tokens[None])[0][0], np.float64)
    want = _reference_logits(path, tokens)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert model.cfg.qkv_bias == options.get("bias", False)
    assert model.cfg.tie_embeddings == options.get("tied", True)


def test_unsupported_files_are_refused_by_name(tmp_path):
    path = tmp_path / "model.gguf"
    _write(path, "llama", T.Q5_0)
    with pytest.raises(ValueError, match=r"type Q5_0, which is not supported; supported: F32, F16, BF16"):
        loader.load(path)
    other = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(other), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'phi3' is not supported; supported: llama, qwen2"):
        loader.load(other)
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        loader.load(text)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        loader.load(tmp_path / "missing.gguf")
