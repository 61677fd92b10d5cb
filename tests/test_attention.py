"""The public attention door: the README's own attention layer gives the decoder's numbers."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flsmem
from flsmem import policies as P
from flsmem.models.decoder import Decoder, DecoderConfig, LayerInfo, Memories

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = DecoderConfig(vocab_size=64, width=32, depth=1, q_heads=4, kv_heads=2, head_dim=8, hidden=64, max_len=64)


def _readme_namespace() -> dict:
    """The README's example of a user's own attention module, executed as printed."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    block = next(b for b in blocks if "class MyAttention" in b)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    return namespace


def _decoder_attention():
    """Layer 0's attention module of a one-layer decoder with random weights."""
    model = Decoder(CFG, nnx.Rngs(3))
    graphdef, stacked = nnx.split(model.blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[0], stacked)).attn


@pytest.mark.parametrize("policy", [P.h2o(recent=4), P.key_norm()], ids=["h2o", "key_norm"])
def test_readme_attention_matches_the_decoder(policy):
    """The README's module (fused projections, its own rotary code, a single memory,
    evidence folded inside attend) and the decoder's attention (stacked memories, its
    rotary code, evidence folded after the step with update_layers) give the same
    outputs and keep the same items, step by step, through several evictions."""
    ns = _readme_namespace()
    reference = _decoder_attention()
    mine = ns["MyAttention"](CFG.width, CFG.q_heads, CFG.kv_heads, CFG.head_dim, rngs=nnx.Rngs(0))
    fused = jnp.concatenate([reference.q.kernel[...], reference.k.kernel[...], reference.v.kernel[...]], axis=1)
    mine.qkv.kernel[...] = fused
    mine.out.kernel[...] = reference.o.kernel[...]

    config = flsmem.MemoryConfig(policy=policy, budget=12, evict_every=4)
    stacked = flsmem.init_kv(config, 2, CFG.kv_heads, CFG.head_dim, layers=1)
    single = flsmem.init_kv(config, 2, CFG.kv_heads, CFG.head_dim)

    @nnx.jit
    def decoder_step(module, x, position, memories):
        layer = LayerInfo(slot=jnp.int32(0), local=jnp.bool_(False), theta=jnp.float32(CFG.rope_theta))
        out, memories, attention = module(x, position, Memories(evictable=memories), layer)
        return out, memories.fold(attention[None]).evictable  # the layer axis a scan adds

    @nnx.jit
    def readme_step(module, x, position, memory):
        return module(x, position, memory)

    xs = jax.random.normal(jax.random.key(5), (40, 2, 1, CFG.width))
    for t in range(40):
        position = jnp.full((2, 1), t, jnp.int32)
        want, stacked = decoder_step(reference, xs[t], position, stacked)
        got, single = readme_step(mine, xs[t], position, single)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    held = lambda m: np.sort(np.where(m.valid, m.position, -1), axis=-1)  # noqa: E731
    np.testing.assert_array_equal(held(single), held(stacked)[0])
    assert int(flsmem.summary(single)["evictions"].sum()) > 0


def test_compress_keeps_the_budget_in_every_layer():
    """A prefill of 24 items compressed to 8 keeps 8 per row, in one layer or stacked."""
    config = flsmem.MemoryConfig(policy=P.h2o(recent=2), budget=8, evict_every=17, max_chunk=24)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 24, 4, 8))
    k, v = (jax.random.normal(key, (1, 24, 2, 8)) for key in keys[1:])
    position = jnp.arange(24, dtype=jnp.int32)[None]
    one = flsmem.init_kv(config, 1, 2, 8)
    _, one, evidence = flsmem.attend(one, q, k, v, position, fold=False)
    one = flsmem.compress(one, evidence, budget=8)
    np.testing.assert_array_equal(flsmem.occupancy(one), 8)
    two = flsmem.init_kv(config, 1, 2, 8, layers=2)
    for layer in range(2):
        _, two, att = flsmem.attend(two, q, k, v, position, fold=False, layer=layer)
    two = flsmem.compress(two, jnp.stack([att, att]), budget=8)
    np.testing.assert_array_equal(jax.vmap(flsmem.occupancy)(two), 8)
    np.testing.assert_array_equal(two.position[0], one.position)


def test_place_with_the_items_fills_in_what_writing_each_layer_does():
    """Placing every layer at once, given the new items, leaves each layer's memory as
    writing that layer's items does (every field but the payload, which place leaves
    for the layers to write), for a policy whose new evidence reads the keys; without
    the items place refuses such a policy and says why."""
    config = flsmem.MemoryConfig(policy=P.key_norm(), budget=8, evict_every=4, max_chunk=6)
    memories = flsmem.init_kv(config, 2, 2, 8, layers=3)
    items = {name: jax.random.normal(jax.random.key(i), (3, 2, 2, 6, 8)) for i, name in enumerate(("k", "v"))}
    position = jnp.tile(jnp.arange(6, dtype=jnp.int32)[None] + 10, (2, 1))
    placed, (target, _) = flsmem.place(memories, position, items)
    for layer in range(3):
        one = jax.tree.map(lambda x: x[layer], memories)
        written = flsmem.write(one, jax.tree.map(lambda x: x[layer], items), position)
        got = jax.tree.map(lambda x: x[layer], placed)
        assert jax.tree.all(jax.tree.map(np.array_equal, got.replace(payload=None), written.replace(payload=None)))
        assert not np.array_equal(written.evidence[0], one.evidence[0])  # the key norms were written
        np.testing.assert_array_equal(target[layer], jnp.broadcast_to(jnp.arange(6), (2, 2, 6)))
    with pytest.raises(ValueError, match="items="):
        flsmem.place(memories, position)
    with pytest.raises(ValueError, match=r"items must be .* \[L, B, K, T, \.\.\.item\]"):
        flsmem.place(memories, position, {"k": items["k"][:, :, :, :, :4], "v": items["v"]})


def test_attend_rejects_bad_arguments():
    config = flsmem.MemoryConfig(policy=P.h2o(), budget=8)
    memory = flsmem.init_kv(config, 1, 2, 8)
    q, kv, position = jnp.zeros((1, 1, 4, 8)), jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="k and v must be"):
        flsmem.attend(memory, q, jnp.zeros((1, 1, 3, 8)), kv, position)
    with pytest.raises(ValueError, match="q must be"):
        flsmem.attend(memory, jnp.zeros((1, 1, 3, 8)), kv, kv, position)
    with pytest.raises(ValueError, match="layer must be given exactly when"):
        flsmem.attend(memory, q, kv, kv, position, layer=0)
    with pytest.raises(ValueError, match="KV memory"):
        flsmem.attend(flsmem.init(config, 1, 2, {"x": (8,)}), q, kv, kv, position)
    with pytest.raises(ValueError, match="with fold=False pass it to flsmem.update"):
        flsmem.attend(memory, q, kv, kv, position, fold=False, correctness=jnp.ones((1, 1)))
    with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
        flsmem.init_kv(config, 1, 2, 0)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_a_decode_steps_bookkeeping_exports_for_every_platform(platform):
    """A user's jitted step (place the new item in every layer, then update them all)
    serialises with ``jax.export`` for each platform with no safety check disabled: no
    custom call without a compatibility guarantee in the library's step."""
    config = flsmem.MemoryConfig(policy=P.rmm(lag=2), budget=8, evict_every=2)
    memories = flsmem.init_kv(config, 1, 2, 4, layers=3)
    slots = memories.valid.shape[-1]

    def step(memories, position, attention):
        memories, _ = flsmem.place(memories, position)
        return flsmem.update_layers(memories, attention)

    args = (memories, jax.ShapeDtypeStruct((1, 1), jnp.int32), jax.ShapeDtypeStruct((3, 1, 2, slots), jnp.float32))
    exported = jax.export.export(jax.jit(step), platforms=[platform])(*args)
    out = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    assert jax.tree.map(jnp.shape, out) == jax.tree.map(jnp.shape, memories)
