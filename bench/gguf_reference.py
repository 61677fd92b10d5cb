"""An independent forward pass and tokenizer of a GGUF file, in numpy and plain Python.

It shares no code with :mod:`flsmem.models.gguf`, the decoder or the tokenizer: it
reads the file's tensors as stored (dequantised with the ``gguf`` package) and computes
what llama.cpp computes, in llama.cpp's layout: adjacent-pair rotation ``(2i, 2i + 1)``
on the permuted Q/K rows for ``llama``, half-split rotation for ``qwen2`` and
``gemma3``, RoPE frequency factors and biases where the file has them, and for
``gemma3`` the scaled embedding, q/k norms, norms after attention and MLP, GeGLU, and
the sliding window on five layers in six with their own RoPE base. For SentencePiece
vocabularies (``tokenizer.ggml.model = "llama"``) :func:`reference_tokens` is
llama.cpp's score-greedy bigram merging, with byte fallback.

    python -m bench.gguf_reference [PATH.gguf] [--long N]

compares the loaded decoder's log-probabilities with it on three fixed prompts (default:
SmolLM2-135M's file) and, with ``--long``, on the first N tokens of Persuasion (past a
sliding window), compares the tokenizers on that text, and prints the largest differences.
"""

from __future__ import annotations

import pathlib

import numpy as np

from flsmem.harness.arguments import make_parser

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
    d, n = field(f"{arch}.attention.key_length", width // heads), len(tokens)

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    def rotate(x, cos, sin):  # [T, heads, D]
        if arch == "llama":  # adjacent pairs, on the converter's permuted rows
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
            return out
        a, b = x[..., :d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    gemma = arch == "gemma3"
    window = field(f"{arch}.attention.sliding_window") if gemma else None
    x = w["token_embd.weight"][np.asarray(tokens)] * (np.sqrt(width) if gemma else 1.0)
    gap = np.arange(n)[:, None] - np.arange(n)[None, :]
    for i in range(layers):
        p = f"blk.{i}."
        local = gemma and i % 6 != 5  # llama.cpp's Gemma 3 pattern: five local layers, then a global one
        cos, sin = _rotation(n, d, 10000.0 if local else theta, w.get("rope_freqs.weight", 1.0))
        h = rms(x, w[p + "attn_norm.weight"])
        proj = lambda name: h @ w[p + name + ".weight"].T + w.get(p + name + ".bias", 0.0)  # noqa: E731
        q, k = proj("attn_q").reshape(n, heads, d), proj("attn_k").reshape(n, kv_heads, d)
        if gemma:
            q, k = rms(q, w[p + "attn_q_norm.weight"]), rms(k, w[p + "attn_k_norm.weight"])
        q, k, v = rotate(q, cos, sin), rotate(k, cos, sin), proj("attn_v").reshape(n, kv_heads, d)
        k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))  # head h reads KV head h // G
        seen = (gap >= 0) & (gap < window) if local else gap >= 0
        logits = np.where(seen, np.einsum("thd,shd->hts", q, k) / np.sqrt(d), -np.inf)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", probs, v).reshape(n, heads * d) @ w[p + "attn_output.weight"].T
        x = x + (rms(out, w[p + "post_attention_norm.weight"]) if gemma else out)
        h = rms(x, w[p + "ffn_norm.weight"])
        gate = h @ w[p + "ffn_gate.weight"].T
        act = (0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3))) if gemma
               else gate / (1 + np.exp(-gate)))
        out = (act * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
        x = x + (rms(out, w[p + "post_ffw_norm.weight"]) if gemma else out)
    return rms(x, w["output_norm.weight"]) @ w.get("output.weight", w["token_embd.weight"]).T


def _rotation(n, d, theta, factors):
    """cos and sin ``[T, 1, D/2]`` of positions 0 .. n-1."""
    freq = theta ** (-np.arange(d // 2) * 2.0 / d) / factors
    angle = np.arange(n)[:, None, None] * freq[None, None, :]
    return np.cos(angle), np.sin(angle)


def reference_tokens(path, text: str) -> list[int]:
    """Token ids of ``text`` by llama.cpp's SentencePiece tokenizer (no BOS): control
    and user-defined tokens matched first, longest first; in between, spaces written
    ``▁``, characters merged pairwise, always the pair whose joined piece scores highest
    (leftmost on ties), and pieces outside the vocabulary spelled as byte tokens."""
    import gguf

    reader = gguf.GGUFReader(path)
    get = lambda key: reader.fields[key].contents()  # noqa: E731
    tokens, scores, kinds = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.scores"), get("tokenizer.ggml.token_type")
    ids = {t: i for i, t in enumerate(tokens)}
    literal = sorted((t for t, k in zip(tokens, kinds) if k in (3, 4)), key=len, reverse=True)
    # Llama 2's files put a space before the text, and again after each literal token.
    prefix = " " if "tokenizer.ggml.add_space_prefix" in reader.fields and get("tokenizer.ggml.add_space_prefix") else ""
    out, start = [], 0
    while start < len(text):
        match = next((t for t in literal if text.startswith(t, start)), None)
        if match is not None:
            out.append(ids[match])
            start += len(match)
            continue
        end = start + 1
        while end < len(text) and next((t for t in literal if text.startswith(t, end)), None) is None:
            end += 1
        out += _merge_by_score((prefix + text[start:end]).replace(" ", "\u2581"), ids, scores)
        start = end
    return out


def _merge_by_score(text: str, ids: dict, scores) -> list[int]:
    pieces = list(text)
    while True:
        best = None
        for j in range(len(pieces) - 1):
            joined = ids.get(pieces[j] + pieces[j + 1])
            if joined is not None and (best is None or scores[joined] > scores[best[1]]):
                best = (j, joined)
        if best is None:
            break
        j = best[0]
        pieces[j:j + 2] = [pieces[j] + pieces[j + 1]]
    out = []
    for piece in pieces:
        out += [ids[piece]] if piece in ids else [ids[f"<0x{b:02X}>"] for b in piece.encode()]
    return out


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main(argv=None) -> float:
    parser = make_parser("python -m bench.gguf_reference", __doc__)
    parser.add_argument("path", nargs="?", help="a GGUF file (default: SmolLM2-135M's, from its wheel)")
    parser.add_argument("--long", type=int, default=0, metavar="N",
                        help="also compare on the first N tokens of Persuasion (past Gemma's 512-token window)")
    args = parser.parse_args(argv)
    from flsmem.models import gguf
    from flsmem.models.data import load_book
    from flsmem.models.smollm2 import gguf_path

    path = args.path or str(gguf_path())
    model, tokenizer = gguf.load(path)
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    prompts = [(prompt[:40], tokenizer.encode(prompt)) for prompt in PROMPTS]
    book = load_book("persuasion")
    if args.long:
        prompts.append((f"Persuasion, first {args.long} tokens", tokenizer.encode(book)[:args.long - len(bos)]))
    worst = 0.0
    print(f"{pathlib.Path(path).name}: log-probabilities of the decoder (float32) against llama.cpp's computation "
          f"in numpy (float64){', BOS first' if bos else ''}")
    for label, tokens in prompts:
        tokens = np.concatenate([np.asarray(bos, np.int32), tokens])
        got = _log_softmax(np.asarray(model(tokens[None])[0][0], np.float64))
        want = _log_softmax(reference_logits(path, tokens))
        diff = float(np.max(np.abs(got - want)))
        worst = max(worst, diff)
        print(f"  {len(tokens):4d} tokens, max |difference| {diff:.2e} nats: {label!r}")
    print(f"max |difference| over {len(prompts)} prompts and every vocabulary entry: {worst:.2e} nats")
    import gguf as gguf_package

    if gguf_package.GGUFReader(path).fields["tokenizer.ggml.model"].contents() == "llama":
        text = book[:20000]
        got, want = tokenizer.encode(text).tolist(), reference_tokens(path, text)
        same = sum(a == b for a, b in zip(got, want))
        print(f"tokenizer: the first {len(text)} characters of Persuasion give {len(got)} tokens, llama.cpp's "
              f"algorithm {len(want)}; {'identical' if got == want else f'{same} equal in place'}")
    return worst


if __name__ == "__main__":
    main()
