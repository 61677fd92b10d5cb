"""ExpectedAttention against a direct numpy computation of kvpress's formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flsmem
from flsmem import policies as P


def _rope_matrix(position, d, theta):
    """The half-split RoPE rotation at ``position`` as a D x D matrix: cos * I + sin * P
    with P mapping (x1, x2) to (-x2, x1)."""
    freq = theta ** (-np.arange(0, d // 2) * 2.0 / d)
    angle = np.concatenate([position * freq, position * freq])
    p = np.zeros((d, d))
    p[d // 2:, :d // 2], p[:d // 2, d // 2:] = np.eye(d // 2), -np.eye(d // 2)
    return np.cos(angle)[:, None] * np.eye(d) + np.sin(angle)[:, None] * p


def _kvpress_scores(raw_q, keys, values, *, theta, future, sinks, group, covariance=True):
    """kvpress's ExpectedAttentionPress.score for one sequence, in float64: raw (pre-RoPE)
    queries ``[T, H, D]``, keys ``[T, K, D]`` and values ``[T, K, D]``; ``[K, T]`` scores
    with the sinks left at NaN (kvpress pads them with the maximum)."""
    t, h, d = raw_q.shape
    q = raw_q[sinks:]
    mu = q.mean(axis=0)  # [H, D]
    centred = q - mu
    cov = np.einsum("thi,thj->hij", centred, centred) / len(q)
    rot = np.mean([_rope_matrix(p, d, theta) for p in range(t, t + future)], axis=0)
    mu = mu @ rot.T
    cov = rot @ cov @ rot.T
    k = np.repeat(keys[sinks:], group, axis=1)  # [T', H, D]
    logits = np.einsum("hd,thd->ht", mu, k) / np.sqrt(d)
    if covariance:
        logits += np.einsum("thi,hij,thj->ht", k, cov, k) / d / 2
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    scores = probs.reshape(keys.shape[1], group, -1).mean(axis=1) * np.linalg.norm(values[sinks:], axis=-1).T
    return np.concatenate([np.full((keys.shape[1], sinks), np.nan), scores], axis=1)


@pytest.mark.parametrize("covariance", [True, False])
def test_matches_kvpress_formula(covariance):
    batch, steps, kv_heads, group, d, theta, future, sinks = 2, 40, 2, 3, 8, 500.0, 16, 4
    rng = np.random.default_rng(0)
    raw_q = rng.normal(size=(batch, steps, kv_heads * group, d)) + 0.5
    keys = rng.normal(size=(batch, steps, kv_heads, d))
    values = rng.normal(size=(batch, steps, kv_heads, d))
    rotated = np.stack([np.stack([raw_q[b, t] @ _rope_matrix(t, d, theta).T for t in range(steps)])
                        for b in range(batch)])

    policy = P.expected_attention(head_dim=d, group=group, rope_theta=theta, future=future, sinks=sinks,
                                  covariance=covariance)
    config = flsmem.MemoryConfig(policy, budget=steps, max_chunk=steps)
    memory = flsmem.init_kv(config, batch, kv_heads, d)
    position = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    # Two chunks, to check that the statistics are folded across calls.
    half = steps // 2
    evidence = []
    for part in (slice(0, half), slice(half, steps)):
        _, memory, att = flsmem.attend(memory, f32(rotated[:, part]), f32(keys[:, part]), f32(values[:, part]),
                                       position[:, part], fold=False)
        evidence.append(att)
    memory = flsmem.observe(memory, evidence[0])
    memory = flsmem.compress(memory, evidence[1], budget=steps)

    score = np.asarray(memory.score)
    held = np.asarray(memory.position)
    for b in range(batch):
        expected = _kvpress_scores(raw_q[b], keys[b], values[b], theta=theta, future=future, sinks=sinks,
                                   group=group, covariance=covariance)
        for k in range(kv_heads):
            slots = np.argsort(np.where(held[b, k] >= 0, held[b, k], 10 ** 6))[:steps]
            got = score[b, k, slots]
            np.testing.assert_allclose(got[sinks:], expected[k, sinks:], rtol=2e-4, atol=1e-7)


def test_evicts_on_the_stream_and_keeps_the_sinks():
    batch, kv_heads, group, d, budget = 1, 2, 2, 8, 12
    policy = P.expected_attention(head_dim=d, group=group, future=8, sinks=2, recent=2)
    config = flsmem.MemoryConfig(policy, budget=budget, evict_every=4)
    memory = flsmem.init_kv(config, batch, kv_heads, d)
    key = jax.random.key(0)

    @jax.jit
    def step(memory, t, key):
        q, k, v = jax.random.normal(key, (3, batch, 1, kv_heads * group, d))
        _, memory, _ = flsmem.attend(memory, q, k[:, :, :kv_heads], v[:, :, :kv_heads],
                                     jnp.full((batch, 1), t, jnp.int32))
        return memory

    for t in range(40):
        memory = step(memory, t, jax.random.fold_in(key, t))
    held = np.asarray(jnp.sum(memory.valid, axis=-1))
    assert (held < budget + 4).all() and int(memory.stats.evictions[0]) > 0
    positions = np.asarray(memory.position)[0]
    for k in range(kv_heads):
        assert {0, 1, 38, 39} <= set(positions[k][positions[k] >= 0].tolist())
    assert float(memory.aux["count"][0, 0]) == 38.0  # the two sink queries left out


def test_refuses_a_model_of_another_shape():
    policy = P.expected_attention(head_dim=8, group=2)
    memory = flsmem.init_kv(flsmem.MemoryConfig(policy, budget=8), 1, 2, 4)
    q = jnp.zeros((1, 1, 4, 4))
    with pytest.raises(ValueError, match="expected_attention was built for .*head_dim=8"):
        flsmem.attend(memory, q, q[:, :, :2], q[:, :, :2], jnp.zeros((1, 1), jnp.int32))
