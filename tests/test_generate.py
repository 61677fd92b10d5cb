"""Generation with a bounded cache: the full-budget output is the full cache's, token for
token; sampling is seeded; ``flsmem generate`` rejects bad input with exit status 2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flsmem
from flsmem import policies as P
from flsmem.harness.cli import main
from flsmem.models.decoder import Decoder, DecoderConfig
from flsmem.models.generate import confidence, sample, stream

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, q_heads=4, kv_heads=2, head_dim=8, hidden=64, max_len=128)
MODEL = Decoder(CFG, nnx.Rngs(0))
PROMPTS = [[3, 9, 27, 17, 51, 25, 11, 33, 35, 41, 59], [5, 8, 13, 21, 34, 55]]
STEPS = 24


def _continuations(policy, budget, **kwargs):
    config = flsmem.MemoryConfig(policy=policy, budget=budget, evict_every=4, max_chunk=4)
    out = [[] for _ in PROMPTS]
    for step in stream(MODEL, config, PROMPTS, STEPS, **kwargs):
        for row in np.flatnonzero(step.emitted):
            out[row].append(int(step.tokens[row]))
    return out


@jax.jit
def _plain_logits(padded):
    return MODEL(padded)[0]


def _plain_greedy(prompt):
    """Greedy decoding by recomputing the whole sequence with the plain causal path
    (padded to one length, so one compiled call serves every step: causal attention
    makes the padding invisible to the positions before it)."""
    seq = list(prompt)
    width = len(prompt) + STEPS
    for _ in range(STEPS):
        padded = jnp.asarray([seq + [0] * (width - len(seq))])
        seq.append(int(jnp.argmax(_plain_logits(padded)[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_full_budget_generates_the_full_cache_output():
    length = max(map(len, PROMPTS)) + STEPS
    full = _continuations(P.full(), length)
    assert all(len(o) == STEPS for o in full)
    assert full == [_plain_greedy(p) for p in PROMPTS]
    assert _continuations(P.h2o(recent=4), length) == full
    assert _continuations(P.rmm(lag=4, recent=4), length + 3) == full


def test_a_small_budget_evicts_and_sampling_is_seeded():
    config = flsmem.MemoryConfig(policy=P.h2o(recent=4), budget=8, evict_every=4, max_chunk=4)
    steps = list(stream(MODEL, config, PROMPTS, STEPS, temperature=1.0, top_p=0.9, seed=3))
    assert steps[-1].evictions > 0 and max(s.held for s in steps) <= 8 + 4
    again = list(stream(MODEL, config, PROMPTS, STEPS, temperature=1.0, top_p=0.9, seed=3))
    assert all((a.tokens == b.tokens).all() for a, b in zip(steps, again))


def test_top_p_keeps_the_smallest_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(sample(logits, jax.random.key(i), 1.0, 0.7)[0]) for i in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there
    assert int(sample(logits, jax.random.key(0), 0.0, 0.7)[0]) == 0


def test_confidence_is_the_greedy_tokens_probability():
    rng = np.random.default_rng(0)
    # Logits far from zero (an overflow of exp without the shift), one row of equal
    # logits and a peaked one.
    logits = np.concatenate([rng.normal(size=(3, 50)) * 8 + 300, np.zeros((1, 50)),
                             np.r_[40.0, np.zeros(49)][None]]).astype(np.float32)
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    expected = np.exp(shifted).max(axis=-1) / np.exp(shifted).sum(axis=-1)
    np.testing.assert_allclose(confidence(jnp.asarray(logits)), expected, rtol=1e-6)
    assert float(confidence(jnp.zeros((1, 50)))[0]) == pytest.approx(1 / 50)


@pytest.mark.parametrize("argv, message", [
    (["--prompt-file", "missing.txt"], "--prompt-file: no such file"),
    (["--prompt-file", "binary.dat"], "is not UTF-8 text"),
    (["--prompt-file", "empty.txt"], "--prompt-file: empty.txt is empty"),
    (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--prompt", "x", "--steps", "0"], "--steps must be >= 1"),
    (["--prompt", "x", "--policy", "nope"], "--policy"),
    (["--prompt", "x", "--policy", "oracle"], "--policy"),
    (["--prompt", "x", "--policy", "adakv(nope)"], "--policy"),
    (["--prompt", "x", "--policy", "pyramid(h2o)"], "--policy pyramid(h2o): layer budgets apply when a prefix"),
    (["--prompt", "x", "--budget", "0"], "--budget and --evict-every must be >= 1"),
])
def test_bad_input_is_one_error_and_exit_status_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "binary.dat").write_bytes(bytes(range(256)))
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
