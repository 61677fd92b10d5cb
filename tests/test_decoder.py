"""The decoder on flsmem memories reproduces the plain decoder where it must."""

import dataclasses
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
        return memories.fold(attention), logits

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
    # The learned estimator's network is shared by a layer's rows: per-token decode folds
    # the layers into rows, each layer's network serving its own; chunks update layer by
    # layer. Both give the same logits.
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
    assert int(memories.evictable.valid.sum(-1).max()) <= 8
    with pytest.raises(ValueError, match="prompt"):
        generate(MODEL, config, prompt[0], steps=2)
    with pytest.raises(ValueError, match="config"):
        generate(MODEL, {"budget": 8}, prompt, steps=2)


# Gemma 3's shape in small: q/k norms, norms after attention and MLP, GeGLU, a scaled
# embedding, and four local layers with a window of 5 around two global ones.
LOCAL = DecoderConfig(vocab_size=64, width=32, depth=6, q_heads=4, kv_heads=1, head_dim=8, hidden=64, max_len=64,
                      activation="gelu_tanh", qk_norm=True, post_norms=True, embed_scale=32 ** 0.5,
                      sliding_window=5, local_layers=(0, 1, 3, 4), local_rope_theta=100.0, rope_theta=1e4)


def test_local_layers_keep_exactly_their_window():
    """Through memories, the local layers hold their window and no more (a bounded
    memory of their own, never touched by the policy), and the logits are the plain
    sliding-window model's; the global layers' memories hold the whole context."""
    model = Decoder(LOCAL, nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.key(4), (2, 24), 0, LOCAL.vocab_size)
    config = flsmem.MemoryConfig(policy=P.full(), budget=24, evict_every=2, max_chunk=3)

    @jax.jit
    def run(memories):
        def step(memories, start):
            positions = jnp.broadcast_to(start + jnp.arange(3)[None, :], (2, 3))
            logits, memories, attention = model(jax.lax.dynamic_slice_in_dim(tokens, start, 3, 1), positions, memories)
            assert attention.shape[0] == 2  # the global layers' evidence only
            held = jnp.sum(memories.windows.valid, axis=-1)  # [4, B, K]
            return memories.fold(attention), (logits, jnp.max(held))

        return jax.lax.scan(step, memories, jnp.arange(0, 24, 3))

    memories, (logits, held) = run(init_memories(LOCAL, config, 2))
    plain = model(tokens)[0]
    np.testing.assert_allclose(jnp.moveaxis(logits, 0, 1).reshape(2, 24, -1), plain, atol=ATOL)
    # Evicted down to the window every 2 items; a chunk of 3 may land on top of 5 + 1.
    assert int(held.max()) <= 5 + 2 + 3 - 1 and int(held[-1]) >= 5
    assert int(flsmem.occupancy(memories.evictable).min()) == 24
    # Without the window the plain model differs: the local layers really forget.
    wide = Decoder(dataclasses.replace(LOCAL, sliding_window=64), nnx.Rngs(3))
    assert not np.allclose(wide(tokens)[0], plain, atol=1e-3)
    with pytest.raises(ValueError, match="at least one layer must be global"):
        dataclasses.replace(LOCAL, local_layers=tuple(range(6)))
    with pytest.raises(ValueError, match="sliding_window and local_layers go together"):
        dataclasses.replace(LOCAL, sliding_window=None)


@pytest.mark.parametrize("policy", [P.h2o(recent=2), P.rmm(lag=3, recent=2), P.snapkv(window=4), P.tova()],
                         ids=lambda p: p.name)
def test_prefill_in_chunks_keeps_what_compressing_the_whole_prefix_keeps(policy):
    """Bounded-memory prefill: each chunk's attention folded as it comes (observe), the
    prefix cut once at the end, keeps the same items as compressing the attention of
    the whole prefix held at once, and the continuation's logits agree."""
    prefix, chunk, budget = 32, 8, 10
    config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=17, max_chunk=prefix)
    weight = jax.random.uniform(jax.random.key(7), (2, prefix))
    positions = lambda start, n: jnp.broadcast_to(start + jnp.arange(n, dtype=jnp.int32), (2, n))  # noqa: E731

    @jax.jit
    def whole(params):
        model = nnx.merge(GRAPHDEF, params)
        _, memories, attention = model(TOKENS[:, :prefix], positions(0, prefix), init_memories(CFG, config, 2))
        return memories.compress(attention, weight, budget=budget)

    @jax.jit
    def chunked(params):
        model = nnx.merge(GRAPHDEF, params)

        def step(memories, start):
            tokens = jax.lax.dynamic_slice_in_dim(TOKENS, start, chunk, 1)
            _, memories, attention = model(tokens, positions(start, chunk), memories)
            return memories.observe(attention, jax.lax.dynamic_slice_in_dim(weight, start, chunk, 1)), None

        memories, _ = jax.lax.scan(step, init_memories(CFG, config, 2), jnp.arange(0, prefix, chunk))
        return memories.compress(budget=budget)

    held = lambda m: np.sort(np.where(m.evictable.valid, m.evictable.position, -1), axis=-1)  # noqa: E731
    a, b = whole(PARAMS), chunked(PARAMS)
    np.testing.assert_array_equal(held(a), held(b))
    assert int(a.evictable.valid.sum(-1).max()) == budget
    np.testing.assert_allclose(a.evictable.score, b.evictable.score, rtol=1e-5, atol=1e-6)
    after = lambda m: MODEL(TOKENS[:, prefix:prefix + 4], positions(prefix, 4), m)[0]  # noqa: E731
    np.testing.assert_allclose(after(a), after(b), atol=ATOL)
