"""bench/: the loops it compares are the ones it claims, its commands check their input,
and a tiny configuration of each runs end to end (seconds, not the real sizes)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flsmem
from bench import (adaptive_weights, common, compile_time, evidence_layout, kernel, learned_flops, overhead,
                   prefill_chunk, profile, pyref, report, ruler_batch, ruler_depth, ruler_resize, ruler_share,
                   ruler_surprise, step_trace)
from bench.loops import plain_cache, plain_step, run_flsmem, run_plain, steady_memories
from flsmem import policies
from flsmem.models.decoder import Decoder, DecoderConfig

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, q_heads=4, kv_heads=2, head_dim=8, hidden=64, max_len=64)
MODEL = Decoder(CFG, nnx.Rngs(0))


@pytest.fixture
def results(tmp_path, monkeypatch):
    """Benchmarks write their JSON under a temporary directory, not results/."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    return tmp_path


def test_plain_loop_is_the_decoder_with_a_full_cache():
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, CFG.vocab_size)
    expected = MODEL(tokens)[0]
    cache = plain_cache(CFG, 2, 24, 0, jax.random.key(0))
    graphdef, params = nnx.split(MODEL)
    step = jax.jit(lambda params, cache, logits, t: plain_step(nnx.merge(graphdef, params), cache, logits, t))
    got = []
    for t in range(20):
        # The step feeds the argmax of its logits: a one-hot of the next token forces it.
        cache, logits, token = step(params, cache, jax.nn.one_hot(tokens[:, t], CFG.vocab_size), t)
        np.testing.assert_array_equal(token, tokens[:, t])
        got.append(logits)
    np.testing.assert_allclose(jnp.stack(got, axis=1), expected, atol=1e-4)


def test_ring_cache_wraps_and_steady_memories_evict_on_schedule():
    cache = plain_cache(CFG, 1, 8, 13, jax.random.key(0))
    assert sorted(np.asarray(cache["position"]).tolist()) == list(range(5, 13))
    assert all(p % 8 == s for s, p in enumerate(np.asarray(cache["position"]).tolist()))
    config = flsmem.MemoryConfig(policy=policies.rmm(lag=4), budget=16, evict_every=4)
    memories = steady_memories(CFG, config, 2, 40, jax.random.key(0))
    graphdef, params = nnx.split(MODEL)
    logits = jnp.zeros((2, CFG.vocab_size))
    after, _ = run_flsmem(graphdef, params, memories, logits, 40, steps=8)
    # Two evictions due in 8 steps, each of 4 items from every row of every layer.
    np.testing.assert_array_equal(after.evictable.stats.evictions, np.full((CFG.depth, 2), 2 * 4 * CFG.kv_heads))
    assert int(after.evictable.stats.forced_writes.sum()) == 0
    plain, _ = run_plain(graphdef, params, plain_cache(CFG, 2, 20, 40, jax.random.key(0)), logits, 40, steps=8)
    assert sorted(np.asarray(plain["position"]).tolist()) == list(range(28, 48))


def test_python_implementation_keeps_what_flsmem_keeps():
    budget, steps = 20, 60
    table = np.random.default_rng(0).random((steps, steps)).astype(np.float32)  # [query, position]
    python = pyref.PythonMemory(rows=1, budget=budget)
    python.fill(0)
    config = flsmem.MemoryConfig(policy=policies.h2o(recent=pyref.RECENT), budget=budget)
    memory = flsmem.init(config, 1, 1, {"k": ()})
    write = jax.jit(lambda m, t: flsmem.write(m, {"k": jnp.zeros((1, 1))}, t[None]))
    update = jax.jit(flsmem.update)
    for t in range(steps):
        slots = python.rows[0]
        free = python.free[0][-1]
        weights = {s: table[t, e["position"]] for s, e in slots.items()}
        weights[free] = table[t, t]
        python.step([None], [weights])
        memory = write(memory, jnp.int32(t))
        position = np.asarray(memory.position[0, 0])
        attention = np.where(position >= 0, table[t, np.maximum(position, 0)], 0.0)
        memory = update(memory, jnp.asarray(attention, jnp.float32)[None, None])
        kept = set(np.asarray(memory.position[0, 0])[np.asarray(memory.valid[0, 0])].tolist())
        assert kept == python.kept_positions()[0], f"step {t}"
    assert len(kept) == budget


@pytest.mark.parametrize(
    "module,argv,message",
    [
        (overhead, ["--batch", "0"], "positive ints"),
        (overhead, ["--batch", "one"], "positive ints"),
        (overhead, ["--models", "gpt2"], "unknown"),
        (overhead, ["--steps", "12", "--evict-every", "8"], "multiple"),
        (overhead, ["--clock", "sundial"], "invalid choice"),
        (overhead, ["--cores", "0"], "--cores must be between 1"),
        (profile, ["--cores", "many"], "--cores must be between 1"),
        (pyref, ["--sizes", "8"], "recent window"),
        (pyref, ["--rows", "0"], "--rows"),
        (kernel, ["--skip", "cuda"], "unknown"),
        (compile_time, ["--rounds", "0"], "--rounds"),
        (compile_time, ["--policies", "learned"], "unknown"),
    ],
)
def test_bad_command_lines_fail_with_a_message(module, argv, message, capsys):
    with pytest.raises(SystemExit):
        module.parse(argv)
    assert message in capsys.readouterr().err


def test_tiny_runs_and_report(results):
    pyref.main(["--sizes", "24", "--rows", "2", "--evict-every", "1,4", "--steps", "4",
                "--python-steps", "1", "--rounds", "1"])
    kernel.main(["--sizes", "256", "--rows", "8", "--rounds", "1", "--skip", "pallas"])
    record = json.loads((results / "pyref.json").read_text())
    assert record["command"].startswith("python -m") or record["command"].startswith("python ")
    assert {"jax", "cpu_cores", "cores_used"} <= set(record["machine"])
    assert [r["evict_every"] for r in record["rows"]] == [1, 4]
    assert all(r["speedup"] > 0 and r["floor_speedup"] > 0 for r in record["rows"])
    stages = ("floors_write", "floors_observe", "floors_no_evict", "floors_learned", "floors")
    assert all(r[stage] > 0 for r in record["rows"] for stage in stages)
    text = report.build()
    assert "Against a per-step Python implementation" in text and "no GPU was lent" in text
    assert "Not run yet: overhead-tiny, overhead" in text


def test_compile_time_compiles_each_part_and_the_report_shows_it(results, capsys):
    compile_time.main(["--policies", "window", "--rounds", "1"])
    record = json.loads((results / "compile-time.json").read_text())
    rows = {row["program"]: row for row in record["rows"]}
    assert list(rows) == ["plain loop", "loop: window", "place (window)", "update_layers (window)",
                          "observe (window)", "smooth (window)", "evict (window)"]
    assert all(row["compile_s"] > 0 and row["lower_s"] > 0 and row["instructions"] > 0 for row in rows.values())
    assert rows["plain loop"]["compile_ratio"] == 1.0
    # The loop holds everything the plain loop does and the memory's bookkeeping besides.
    assert rows["loop: window"]["instructions"] > rows["plain loop"]["instructions"]
    assert rows["update_layers (window)"]["instructions"] > rows["smooth (window)"]["instructions"]
    assert "## Compile time, part by part (tiny)" in report.build()


def test_learned_flops_counts_the_model_and_the_network_by_hand(results, capsys):
    learned_flops.main(["--models", "tiny", "--evict-every", "8"])
    (row,) = json.loads((results / "learned-flops.json").read_text())["rows"]
    # The tiny decoder: 4 layers of q, o (128 x 128), k, v (128 x 64) and three MLP
    # matrices (128 x 384), the tied 256 x 128 table as the output; the attention's two
    # products per query head (4 heads of 32) over 256 + 8 slots.
    weights = 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384) + 256 * 128
    assert row["model_flops"] == 2 * weights + 4 * 4 * 264 * 32 * 2 * 2
    # The network over 4 layers x 2 KV heads x 264 slots: 19 features to 1 and to 32,
    # 32 to 32, 32 to 1; XLA adds the biases and activations to the products.
    slots = 4 * 2 * 264
    products = 2 * slots * (19 + 19 * 32 + 32 * 32 + 32)
    assert row["network_slots"] == slots and products <= row["forward_flops"] <= 1.5 * products
    assert row["learn_flops"] > 2 * row["forward_flops"]  # a forward, its gradient and the update
    assert row["scoring_share"] == pytest.approx(row["forward_flops"] / 8 / row["model_flops"])
    assert row["learning_share"] == pytest.approx(row["learn_flops"] / row["learn_period"] / row["model_flops"])
    assert "tiny" in capsys.readouterr().out


def test_step_trace_names_the_operations_of_the_step(capsys):
    step_trace.main(["--n", "24", "--rows", "2", "--steps", "4", "--evict-every", "1", "--top", "5"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("h2o, N=24 rows=2 evict_every=1")
    assert 1 < len(lines) <= 6 and all(float(line.split()[0]) >= 0 for line in lines[1:])


def test_step_trace_of_a_serving_loop_counts_each_loops_operations(capsys):
    step_trace.main(["--model", "tiny", "--steps", "2", "--evict-every", "1", "--top", "3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("tiny, batch 1, h2o, budget 256, evict_every 1")
    plain, flsmem = (int(line.split()[1]) for line in lines[1:3])
    assert lines[1].startswith("plain") and lines[2].startswith("flsmem") and flsmem > plain > 0
    assert len(lines) == 7 and all(float(line.split()[0]) >= 0 for line in lines[4:])


def test_each_evidence_layout_folds_as_the_kalman_policy_does():
    """The three layouts give the Kalman filter's update: new (mean, variance, count) on
    present slots, the old evidence on the others."""
    rng = np.random.default_rng(0)
    present = jnp.asarray(rng.random((1, 2, 16)) < 0.5)
    z = jnp.asarray(rng.random((1, 2, 16)), jnp.float32)
    filled = jnp.asarray(np.stack([rng.random((1, 2, 16)), rng.random((1, 2, 16)), rng.integers(0, 3, (1, 2, 16))]),
                         jnp.float32)
    policy = policies.kalman(q=0.1, r=0.5)
    got = {layout: fold(evidence_layout.starting_evidence(layout, filled), z)
           for layout, (fold, _) in evidence_layout.folds(policy, present).items()}
    library = np.stack(got[evidence_layout.LAYOUTS[2]])
    np.testing.assert_allclose(np.moveaxis(np.asarray(got[evidence_layout.LAYOUTS[0]]), -1, 0), library, rtol=1e-6)
    np.testing.assert_allclose(np.moveaxis(np.asarray(got[evidence_layout.LAYOUTS[1]]), 2, 0), library, rtol=1e-6)
    m, var, n = np.asarray(filled)
    gain = np.where(n == 0, 1.0, (var + 0.1) / (var + 0.1 + 0.5))
    expected = np.stack([m + gain * (np.asarray(z) - m), np.where(n == 0, 0.5, (1 - gain) * (var + 0.1)), n + 1])
    np.testing.assert_allclose(library, np.where(np.asarray(present), expected, np.asarray(filled)), rtol=1e-6)


def test_evidence_layout_writes_its_table_and_the_report_shows_it(results, capsys):
    evidence_layout.main(["--n", "32", "--rows", "2", "--steps", "2", "--rounds", "1", "--policies", "kalman"])
    record = json.loads((results / "evidence-layout.json").read_text())
    assert list(record["ratios"]) == list(evidence_layout.LAYOUTS)
    assert record["ratios"][evidence_layout.LAYOUTS[0]]["median"] == 1.0
    # The filter's step copies one [B, K, S] float array (into the write's scatter), not its evidence twice.
    assert [shape for shape in record["step_copies"]["kalman"] if shape.startswith("f32")] == ["f32[1,6,576]"]
    assert "one array per column" in capsys.readouterr().out
    built = report.build()
    assert "## Evidence of several columns: its layout" in built and "| kalman | " in built


def test_a_prefill_chunk_is_the_plain_forward_of_its_tokens():
    memories, prefill, plain, tokens = prefill_chunk.chunk_functions(MODEL, 40, 16)
    last, memories = prefill(memories, tokens)
    np.testing.assert_allclose(last, plain(tokens), atol=1e-5)
    assert memories.evictable.valid.shape[-1] == 40 and int(memories.evictable.valid.sum()) == 2 * 2 * 16


def test_prefill_chunk_writes_its_ratio_and_operations_and_the_report_shows_them(results, capsys):
    prefill_chunk.main(["--model", "tiny", "--slots", "64", "--chunk", "16", "--rounds", "1", "--top", "3"])
    row = json.loads((results / "prefill-chunk.json").read_text())["rows"][0]
    assert row["slots"] == 64 and row["vs_plain"]["median"] > 0 and 1 <= len(row["operations"]) <= 3
    assert "x" in capsys.readouterr().out
    text = report.build()
    assert "One prefill chunk against the plain forward" in text and f"`{row['operations'][0]['operation']}`" in text
    with pytest.raises(SystemExit):
        prefill_chunk.main(["--model", "tiny", "--slots", "20", "--chunk", "16"])


def test_ruler_share_times_shared_and_separate_answers_and_the_report_shows_them(results, capsys):
    ruler_share.main(["--model", "tiny", "--length", "512", "--policies", "h2o,streaming_llm", "--rounds", "1"])
    record = json.loads((results / "ruler-share.json").read_text())
    assert record["arms"] == [["h2o", 0.25], ["streaming_llm", 0.25]] and record["speedup"]["median"] > 0
    assert "speed-up of sharing the prefill" in capsys.readouterr().out
    assert "| tiny | 512 | niah_single_2 | question-agnostic | h2o 0.25, streaming_llm 0.25 | x" in report.build()


def test_ruler_resize_times_the_cut_memory_both_ways_and_the_report_shows_them(results, capsys):
    ruler_resize.main(["--model", "tiny", "--length", "512", "--policies", "h2o,snapkv", "--rounds", "1"])
    record = json.loads((results / "ruler-resize.json").read_text())
    assert record["arms"] == [["h2o", 0.25], ["snapkv", 0.25]] and record["speedup"]["median"] > 0
    assert record["answers"] == 4 and 0 <= record["answers_differing"] <= 4
    assert "speed-up of resizing the cut memory" in capsys.readouterr().out
    assert "| tiny | 512 | niah_single_2 | question-agnostic | h2o 0.25, snapkv 0.25 | x" in report.build()



def test_ruler_batch_times_batched_and_one_at_a_time_answers_and_the_report_shows_them(results, capsys):
    ruler_batch.main(["--model", "tiny", "--length", "512", "--policies", "h2o,oracle", "--batch", "2",
                      "--rounds", "1"])
    record = json.loads((results / "ruler-batch.json").read_text())
    assert record["arms"] == [["h2o", 0.25], ["oracle", 0.25]] and record["speedup"]["median"] > 0
    assert record["batch"] == 2 and record["answers"] == 8 and 0 <= record["answers_differing"] <= 8
    assert "speed-up of decoding 2 samples as a batch" in capsys.readouterr().out
    assert "| tiny | 512 | niah_single_2 | question-agnostic | h2o 0.25, oracle 0.25 | 2 | x" in report.build()
    with pytest.raises(SystemExit):
        ruler_batch.main(["--model", "tiny", "--length", "512", "--batch", "1"])

def test_the_report_says_which_prefixes_a_stopped_memory_run_left_undone(results):
    row = {"prefix": 256, "policy": "h2o", "peak_mb": 900.0, "seconds": 2.0, "time_vs_first_full": 1.0, "nll": 3.0}
    record = {"command": "python -m bench.prefill_memory --model tiny --prefixes 256,512,1024 --scored 64",
              "commit": "abc", "machine": {"cpu_cores": 2, "cpu": "x86_64", "backend": "cpu", "jax": "0",
                                           "python": "3", "os": "Linux", "devices": ["cpu"]},
              "model": "tiny", "budget": 512, "chunk": 16, "scored": 64, "rows": [row]}
    (results / "prefill-memory.json").write_text(json.dumps(record))
    assert "stopped before it reached 512, 1024 tokens" in report.build()
    (results / "prefill-memory.json").write_text(json.dumps({**record, "command": record["command"].replace(
        "256,512,1024", "256")}))
    assert "stopped before it reached" not in report.build()


def test_quick_pyref_is_one_size_on_one_core():
    args = pyref.parse(["--quick"])
    assert (args.sizes, args.rounds, args.cores, args.out) == ([1024], 3, 1, "pyref-quick")


def test_quick_overhead_runs_on_one_core_unless_told():
    assert overhead.parse(["--quick"]).cores == 1
    assert overhead.parse(["--quick", "--cores", "1"]).cores == 1
    assert overhead.parse([]).cores is None
    assert overhead.parse(["--quick", "--cores", "all"]).cores == len(os.sched_getaffinity(0))


def test_adaptive_weights_are_a_distribution_per_layer(tmp_path, capsys):
    adaptive_weights.main(["--model", "tiny", "--context", "64", "--windows", "1", "--budgets", "16",
                           "--out", str(tmp_path / "weights")])
    run = json.loads((tmp_path / "weights.json").read_text())["runs"]["16"]
    weights = np.asarray(run["weights"])
    assert run["experts"] == ["rmm", "h2o", "ema0.9"] and weights.shape == (4, 3)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-5)
    assert (tmp_path / "weights.png").stat().st_size > 0
    assert "final weight of each expert per layer" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        adaptive_weights.main(["--policy", "h2o", "--out", str(tmp_path / "other")])
    assert exit_.value.code == 2 and "--policy must be adaptive" in capsys.readouterr().err


def test_ruler_depth_counts_hits_by_the_needles_distance_from_the_end(tmp_path, capsys):
    from flsmem.harness.ruler.tasks import make_sample
    from flsmem.models.data import ByteTokenizer

    tokenizer = ByteTokenizer()
    # After the answer: " bbb" and the question " q?", one token a byte.
    hand = {"context": "aa 1234567 bbb", "question": " q?", "answers": ["1234567"]}
    assert ruler_depth.distance_to_end(hand, tokenizer) == 7
    # Bands of half a budget B: [0, B/2), [B/2, B), [B, ...); B // 2 for an odd B.
    assert [ruler_depth.band(d, 8) for d in (0, 3, 4, 7, 8, 100)] == [0, 0, 1, 1, 2, 2]
    assert [ruler_depth.band(d, 7) for d in (2, 3, 6, 7)] == [0, 1, 1, 2]
    indices = (3, 2, 1)
    distances = [ruler_depth.distance_to_end(make_sample("niah_single_1", 2048, i, tokenizer, 0), tokenizer)
                 for i in indices]
    budget = 800
    assert distances[0] < budget // 2 <= distances[1] < budget <= distances[2]  # one sample in each band
    rows = [{"model": "tiny", "task": "niah_single_1", "length": 2048, "index": i, "seed": 0, "policy": policy,
             "protocol": "stream", "budget": 0.5, "evict_every": 16, "budget_tokens": budget, "score": score}
            for i in indices for policy, score in (("full", 1.0), ("h2o", float(i != 3)))]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ruler_depth.main([str(path)])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("h2o"))
    # The full cache is not counted; h2o missed the nearest needle and found the other two.
    assert line.split() == ["h2o", "stream", str(budget), "0", "/", "1", "1", "/", "1", "1", "/", "1"]


def test_ruler_surprise_counts_the_tokens_the_model_mispredicts():
    from flsmem.models.data import ByteTokenizer

    tokenizer = ByteTokenizer()
    # One token a byte, each below the model's vocabulary of 64: the answer is bytes 3 to 9.
    sample = {"context": "55 1234567 888" * 3, "question": " 0?", "answers": ["1234567"]}
    assert ruler_surprise.answer_span(sample["context"], "1234567", tokenizer) == (3, 10)
    ids = np.asarray(tokenizer.encode(sample["context"]), np.int32)
    # Token t is missed when the model's argmax after tokens < t is not token t.
    logits = np.asarray(MODEL(jnp.asarray(ids)[None])[0][0], np.float64)
    missed = np.concatenate([[False], logits[:-1].argmax(-1) != ids[1:]])
    logp = logits[:-1] - np.log(np.exp(logits[:-1]).sum(-1, keepdims=True))
    surprisal = np.concatenate([[0.0], -logp[np.arange(len(ids) - 1), ids[1:]]])
    got = ruler_surprise.measure(MODEL, tokenizer, sample, budget=0.5)
    # 45 prompt tokens: a recent window of 11, a scored half of 11; the missed tokens
    # beyond the window are those of the first 34. An answer token's rank: one more
    # than the tokens among those 34 more surprising than it (no ties here).
    beyond = surprisal[:34]
    assert len(set(beyond.round(4))) == 34
    ranks = [1 + int(np.sum(beyond > surprisal[t])) for t in range(3, 10)]
    assert got.pop("answer_ranks") == ranks
    assert got == pytest.approx({"context_missed": missed.mean(), "beyond": int(missed[:34].sum()),
                                 "scored_half": 11, "answer_missed": missed[3:10].mean(), "reserve": 45 // 2 // 8})


def test_the_median_interval_is_the_order_statistics_with_95_percent_coverage():
    # n = 9: P(x_(2) <= median <= x_(8)) = 1 - 2 (1 + 9) / 2**9 = 0.961; x_(3)..x_(7) covers 0.820.
    assert common.median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (2, 8)
    # n = 15: x_(4)..x_(12) covers 1 - 2 (1 + 15 + 105 + 455) / 2**15 = 0.965.
    assert common.median_interval(list(range(15, 0, -1))) == (4, 12)
    # Under 6 rounds even the whole range covers less than 95%: it is all there is.
    assert common.median_interval([3, 1, 2, 5, 4]) == (1, 5)


@pytest.mark.parametrize("low, high, verdict", [(-0.01, 0.02, "holds"), (0.031, 0.2, "does not hold"),
                                                (0.01, 0.04, "not resolved")])
def test_an_overhead_goal_is_decided_by_the_interval_of_its_median(low, high, verdict):
    row = {"overhead": (low + high) / 2, "overhead_low": -0.5, "overhead_high": 0.5,
           "overhead_median_low": low, "overhead_median_high": high}
    assert report.overhead_verdict(row, 0.03).startswith(verdict)
    assert report.overhead_verdict({"overhead": 0.0, "overhead_low": 0.0, "overhead_high": 0.0}, 0.03).startswith(
        "not decided")


def test_shift_needle_finds_the_needle_and_counts_what_each_memory_holds():
    from bench.shift_needle import needle_positions, retention
    from flsmem.harness.ruler.forced import forced_window
    from flsmem.models.data import ByteTokenizer

    tokens, answer = forced_window("niah_single_2", 512, 0, ByteTokenizer(), seed=1)
    needle = needle_positions(tokens, answer)
    gold = bytes(tokens[1:][answer].astype(np.uint8)).decode()
    assert bytes(tokens[needle].astype(np.uint8)).decode() == gold and needle[-1] < np.flatnonzero(answer)[0]
    # Two layers, one window, three KV heads: all of it, three eighths, nothing.
    held = np.full((2, 1, 3, 10), -1)
    held[0, 0, 1, :len(needle)] = needle
    held[1, 0, 2, :3] = needle[:3]
    np.testing.assert_allclose(retention(held, [needle])[:, 0], [[0, 1, 0], [0, 0, 3 / len(needle)]])


@pytest.mark.parametrize("argv, message", [(["--fraction", "2"], "--fraction must be a fraction in (0, 1)"),
                                           (["--fraction", "half"], "--fraction"),
                                           (["--examples", "12"], "--examples must be a positive multiple of 8"),
                                           (["--json", "no/such/folder/needle.json"], "--json")])
def test_shift_needle_refuses_a_bad_command_line_before_any_work(argv, message, capsys):
    from bench import shift_needle

    with pytest.raises(SystemExit) as exit_:
        shift_needle.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


# Options of these commands have no default to show (kernel_check's one option is a flag,
# ruler_depth takes only its results file).
_NO_DEFAULTS = {"kernel_check", "ruler_depth"}


def test_every_benchmark_gives_its_defaults_in_help(capsys):
    import importlib
    import pathlib

    names = sorted(p.stem for p in pathlib.Path(common.__file__).parent.glob("*.py") if p.stem != "__init__")
    commands = {}
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        entry = getattr(module, "parse", None) or getattr(module, "main", None)
        if entry is not None:
            commands[name] = entry
    assert len(commands) >= 19
    for name, entry in commands.items():
        with pytest.raises(SystemExit) as stop:
            entry(["--help"])
        text = capsys.readouterr().out
        assert stop.value.code == 0 and text.startswith(f"usage: python -m bench.{name}"), name
        assert ("(default:" in text) == (name not in _NO_DEFAULTS), name


def test_a_stopped_overhead_run_keeps_its_finished_batches_and_a_rerun_skips_them(results, monkeypatch, capsys):
    monkeypatch.setattr(common, "commit", lambda: "abc1234")
    monkeypatch.setattr(common, "command", lambda: "python -m bench.overhead --batch 1,8")
    monkeypatch.setattr(common, "load_model", lambda name: MODEL)
    measured, stop = [], [True]

    def measure(model, name, batch, pols, evict_every, steps, rounds):
        if batch == 8 and stop:
            stop.pop()
            raise InterruptedError  # the first run is stopped during batch 8
        measured.append(batch)
        return [{"model": name, "batch": batch, "policy": "rmm", "evict_every": 8, "overhead": 0.01 * batch,
                 "overhead_median_low": 0.0, "overhead_median_high": 0.1, "overhead_low": 0.0, "overhead_high": 0.1,
                 "first_call_ratio": 1.0}]

    monkeypatch.setattr(overhead, "measure", measure)
    argv = ["--models", "tiny", "--batch", "1,8", "--policies", "rmm", "--evict-every", "8"]
    with pytest.raises(InterruptedError):
        overhead.main(argv)
    assert not (results / "overhead.json").exists()
    assert list(json.loads((results / "partial" / "overhead.json").read_text())["parts"]) == ["tiny, batch 1"]
    overhead.main(argv)
    assert measured == [1, 8]  # batch 1 came from the partial file
    assert [r["batch"] for r in json.loads((results / "overhead.json").read_text())["rows"]] == [1, 8]
    assert not (results / "partial" / "overhead.json").exists()
    # Saved by other code, a partial file is not reused.
    common.Partial("overhead").put("tiny, batch 1", [])
    monkeypatch.setattr(common, "commit", lambda: "def5678")
    assert common.Partial("overhead").get("tiny, batch 1") is None
    assert "not reused" in capsys.readouterr().err
