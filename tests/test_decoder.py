"""The decoder on flsmem memories reproduces the plain decoder where it must."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flsmem
from flsmem import policies as P
from flsmem.models.decoder import Decoder, DecoderConfig, init_memories, rope

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, q_heads=4, kv_heads=2, head_dim=8, hidden=64, max_len=64)
MODEL = Decoder(CFG, nnx.Rngs(0))
GRAPHDEF, PARAMS = nnx.split(MODEL)
TOKENS = jax.random.randint(jax.random.key(1), (2, 48), 0, CFG.vocab_size)
# float32 attention over different summation orders: agreement to this tolerance.
ATOL = 1e-4


@functools.partial(jax.jit, static_argnames=("config", "chunk"))
def stream_logits(params, tokens, config, chunk):
    """Logits of ``tokens`` fed ``chunk`` at a time through per-layer memories."""
    model = nnx.merge(GRAPHDEF, params)
    b, t = tokens.shape

    def step(memories, start):
        positions = jnp.broadcast_to(start + jnp.arange(chunk)[None, :], (b, chunk))
        logits, memories, attention = model(jax.lax.dynamic_slice_in_dim(tokens, start, chunk, 1), positions, memories)
        return flsmem.update_layers(memories, attention), logits

    _, logits = jax.lax.scan(step, init_memories(CFG, config, b), jnp.arange(0, t, chunk))
    return jnp.moveaxis(logits, 0, 1).reshape(b, t, -1)


@functools.partial(jax.jit, static_argnames=("window",))
def plain_logits(params, tokens, window=None):
    return nnx.merge(GRAPHDEF, params)(tokens, window=window)[0]


def test_full_policy_gives_the_plain_decoders_logits():
    config = flsmem.MemoryConfig(policy=P.full(), budget=48, max_chunk=8)
    np.testing.assert_allclose(stream_logits(PARAMS, TOKENS, config, 8), plain_logits(PARAMS, TOKENS), atol=ATOL)


def test_per_token_decode_matches_chunked_prefill():
    # Evicting every 8 items from chunks of 8 is what per-token decode does with
    # evict_every=8 (budget a multiple of 8, so evictions fall on chunk ends).
    config = flsmem.MemoryConfig(policy=P.h2o(recent=4), budget=16, evict_every=8, max_chunk=8)
    chunked = stream_logits(PARAMS, TOKENS, config, 8)
    per_token = stream_logits(PARAMS, TOKENS, config.replace(max_chunk=1), 1)
    np.testing.assert_allclose(per_token, chunked, atol=ATOL)
    # And eviction changed something: the full cache differs.
    assert not np.allclose(chunked, plain_logits(PARAMS, TOKENS), atol=1e-3)


def test_per_token_decode_with_a_shared_policy_state():
    # The learned estimator's network is shared by a layer's rows, so per-token decode
    # cannot fold layers into rows; it updates layer by layer and matches the chunks.
    from flsmem import estimator

    policy = estimator.learned(horizon=8, snapshots=2, hidden=4, learning_rate=1e-2).replace(recent=4)
    config = flsmem.MemoryConfig(policy=policy, budget=16, evict_every=8, max_chunk=8)
    chunked = stream_logits(PARAMS, TOKENS, config, 8)
    per_token = stream_logits(PARAMS, TOKENS, config.replace(max_chunk=1), 1)
    np.testing.assert_allclose(per_token, chunked, atol=ATOL)
    assert not np.allclose(chunked, plain_logits(PARAMS, TOKENS), atol=1e-3)


def test_window_policy_is_sliding_window_attention():
    # Evicting one item per step to a budget of 12: query t sees positions t-12 .. t.
    config = flsmem.MemoryConfig(policy=P.window(), budget=12)
    np.testing.assert_allclose(
        stream_logits(PARAMS, TOKENS, config, 1), plain_logits(PARAMS, TOKENS, window=12), atol=ATOL
    )


def test_rope_is_a_rotation_by_relative_position():
    x = jax.random.normal(jax.random.key(2), (1, 1, 2, 8))
    y = jax.random.normal(jax.random.key(3), (1, 1, 2, 8))
    dot = lambda a, b: jnp.sum(rope(x, jnp.array([[a]]), 100.0) * rope(y, jnp.array([[b]]), 100.0))  # noqa: E731
    np.testing.assert_allclose(dot(3, 1), dot(10, 8), rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(rope(x, jnp.array([[7]]), 100.0)), jnp.linalg.norm(x), rtol=1e-6)


def test_bad_decoder_arguments():
    with pytest.raises(ValueError, match="kv_heads"):
        DecoderConfig(vocab_size=8, width=8, depth=1, q_heads=3, kv_heads=2, head_dim=4, hidden=8)
    with pytest.raises(ValueError, match="head_dim"):
        DecoderConfig(vocab_size=8, width=8, depth=1, q_heads=2, kv_heads=2, head_dim=5, hidden=8)
    with pytest.raises(ValueError, match="tokens"):
        MODEL(TOKENS[0])
    with pytest.raises(ValueError, match="tokens"):
        MODEL(TOKENS.astype(jnp.float32))
    with pytest.raises(ValueError, match="positions"):
        MODEL(TOKENS, positions=jnp.zeros((2, 3), jnp.int32))
    config = flsmem.MemoryConfig(policy=P.full(), budget=8)
    with pytest.raises(ValueError, match="memories"):
        MODEL(TOKENS[:, :1], memories=flsmem.init(config, 2, CFG.kv_heads, {"k": (8,), "v": (8,)}))


def test_generate_with_the_full_cache_is_plain_greedy_decoding():
    from flsmem.models.generate import generate

    prompt = TOKENS[:, :12]
    config = flsmem.MemoryConfig(policy=P.full(), budget=24, max_chunk=5)  # 12 = 5 + 5 + 2
    tokens, memories = generate(MODEL, config, prompt, steps=6)
    seq = prompt
    for _ in range(6):  # greedy by recomputing the whole prefix
        seq = jnp.concatenate([seq, jnp.argmax(plain_logits(PARAMS, seq)[:, -1], axis=-1)[:, None]], axis=1)
    np.testing.assert_array_equal(tokens, seq[:, 12:])
    # A small budget still decodes, and never holds more than budget + evict_every.
    tokens, memories = generate(MODEL, config.replace(policy=P.rmm(lag=2), budget=6, evict_every=2), prompt, steps=6)
    assert tokens.shape == (2, 6)
    assert int(memories.valid.sum(-1).max()) <= 8
    with pytest.raises(ValueError, match="prompt"):
        generate(MODEL, config, prompt[0], steps=2)
    with pytest.raises(ValueError, match="config"):
        generate(MODEL, {"budget": 8}, prompt, steps=2)
