"""The evaluation harness: exact where it must be, and ``flsmem eval`` end to end."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flsmem import policies as P
from flsmem.harness.evaluate import (evaluate_nll, future_attention, is_policy_name, make_policy, run_comparison,
                                     split_policies, split_settings)
from flsmem.harness.report import format_table, parse_budgets
from flsmem.models.data import cut_windows
from flsmem.models.decoder import Decoder, DecoderConfig

CFG = DecoderConfig(vocab_size=64, width=32, depth=2, q_heads=4, kv_heads=2, head_dim=8, hidden=64, max_len=64)
MODEL = Decoder(CFG, nnx.Rngs(0))
WINDOWS = np.asarray(jax.random.randint(jax.random.key(1), (2, 33), 0, CFG.vocab_size), np.int32)


def plain_nll(windows):
    logits = MODEL(jnp.asarray(windows[:, :-1]))[0]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -np.take_along_axis(np.asarray(logp), windows[:, 1:, None], axis=-1)[..., 0]


def test_full_cache_streaming_equals_the_plain_model():
    nll, _ = evaluate_nll(MODEL, WINDOWS, P.full(), 32, chunk=8)
    np.testing.assert_allclose(nll, plain_nll(WINDOWS), atol=1e-4)


@pytest.mark.parametrize("name", ["h2o", "rmm", "tova", "snapkv", "kalman"])
def test_a_budget_that_holds_everything_changes_nothing(name):
    nll, stats = evaluate_nll(MODEL, WINDOWS, make_policy(name, 32), 32, chunk=8)
    np.testing.assert_allclose(nll, plain_nll(WINDOWS), atol=1e-4)
    assert int(np.sum(stats["evictions"])) == 0


def test_eviction_changes_the_likelihood_and_is_counted():
    nll, stats = evaluate_nll(MODEL, WINDOWS, make_policy("h2o", 8), 8, chunk=8)
    assert not np.allclose(nll, plain_nll(WINDOWS), atol=1e-3)
    # Each layer, window and KV head keeps 8 of 32 tokens: 24 evictions per row.
    np.testing.assert_array_equal(stats["evictions"], np.full((CFG.depth, 2), 24 * CFG.kv_heads))


def test_future_attention_sums_later_queries():
    futures = future_attention(MODEL, WINDOWS, 8, discount=1.0)  # [L, W, K, T, T]
    assert futures.shape == (CFG.depth, 2, CFG.kv_heads, 32, 32)
    # Query t's row sums to 1 over positions <= t, so what is still to come after t,
    # summed over positions, is the number of later queries (heads averaged).
    np.testing.assert_allclose(np.asarray(futures.sum(-1)), np.broadcast_to(31 - np.arange(32), futures.shape[:-1]), rtol=1e-4)
    # Discounted: sum over later queries s of 0.5^(s - t - 1).
    half = future_attention(MODEL, WINDOWS, 8, discount=0.5)
    expected = 2.0 * (1.0 - 0.5 ** (31 - np.arange(32)))
    np.testing.assert_allclose(np.asarray(half.sum(-1)), np.broadcast_to(expected, half.shape[:-1]), rtol=1e-4)


def test_comparison_rows_and_gap_closed():
    seen = {}

    def keep(name, budget, stats):
        seen[(name, budget)] = stats

    rows = run_comparison(MODEL, WINDOWS, np.full((2, 2), 32), [8], ["streaming_llm", "h2o", "oracle"], chunk=8,
                          on_stats=keep)
    by = {(r.policy, r.budget): r for r in rows}
    # The memory statistics come from the same runs as the rows (no second run): h2o at 8
    # evicts the same 24 items per layer, window and KV head as evaluate_nll's own run.
    assert set(seen) == set(by)
    np.testing.assert_array_equal(seen[("h2o", 8)]["evictions"], np.full((CFG.depth, 2), 24 * CFG.kv_heads))
    assert int(np.sum(seen[("full", 32)]["evictions"])) == 0
    assert by[("full", 32)].delta_vs_full == 0.0
    assert by[("streaming_llm", 8)].gap_closed == 0.0
    assert by[("oracle", 8)].gap_closed == pytest.approx(1.0)
    h2o = by[("h2o", 8)]
    assert h2o.delta_vs_full == pytest.approx(h2o.nll - by[("full", 32)].nll)


def test_prefill_protocol_compresses_once():
    rows = run_comparison(MODEL, WINDOWS, np.full((2, 2), 8), [8], ["streaming_llm", "snapkv"],
                          chunk=8, protocol="prefill", prefill_fraction=0.75)
    assert {r.policy for r in rows} == {"full", "streaming_llm", "snapkv"}
    # The scored part is the last quarter (8 tokens) of each window.
    full = next(r for r in rows if r.policy == "full")
    np.testing.assert_allclose(full.nll, plain_nll(WINDOWS)[:, 24:].mean(), rtol=1e-4)


def test_the_peers_by_name_in_the_prefill_protocol():
    # kvpress's peers and the budget wrappers, built for the model at hand.
    ea = make_policy("expected_attention", 16, model=CFG)
    assert (ea.params.head_dim, ea.params.group, ea.sinks) == (CFG.head_dim, CFG.group, 4)
    ada = make_policy("adakv(h2o)", 16, model=CFG)
    assert ada.head_budget.ceiling == pytest.approx(2 - 0.2) and ada.recent == 8
    with pytest.raises(ValueError, match="expected_attention needs the model"):
        make_policy("expected_attention", 16)
    rows = run_comparison(MODEL, WINDOWS, np.full((2, 2), 8), [12],
                          ["h2o", "adakv(expected_attention)", "pyramid(h2o)"], chunk=8, protocol="prefill")
    by = {r.policy: r for r in rows}
    assert set(by) == {"full", "h2o", "adakv(expected_attention)", "pyramid(h2o)"}
    assert all(np.isfinite(r.nll) for r in rows)
    # Two layers, so the pyramid gives the lower one more: another cut than h2o's.
    assert by["pyramid(h2o)"].nll != by["h2o"].nll


def test_policy_settings_reach_the_factory_over_the_budgets_defaults():
    assert split_policies("adaptive(horizon=256, forget=0.999),h2o") == ["adaptive(horizon=256, forget=0.999)", "h2o"]
    assert split_settings("adaptive(horizon=256, decays=(1.0, 0.5))") == ("adaptive", {"horizon": 256,
                                                                                     "decays": (1.0, 0.5)})
    assert split_settings("adakv(h2o)") == ("adakv(h2o)", {})
    tuned = make_policy("adaptive(horizon=256, forget=0.999)", 64)
    default = make_policy("adaptive", 64)
    assert (tuned.params.horizon, tuned.params.forget) == (256, 0.999)
    assert (tuned.recent, tuned.lag) == (default.recent, default.lag) == (32, 16)  # the budget's defaults stay
    assert make_policy("surprise_reserve(reserve=3)", 64).params.reserve == 3  # over the preset's 64 // 8
    assert make_policy("adakv(surprise(reserve=3))", 64, model=CFG).params.reserve == 3
    assert make_policy("h2o(recent=5)", 64).recent == 5
    # A count of slots as a fraction is a share of each budget, rounded down.
    assert make_policy("rmm(recent=0.875)", 256) == make_policy("rmm(recent=224)", 256)
    assert make_policy("rmm(recent=0.875)", 100).recent == 87
    assert make_policy("surprise_reserve(reserve=0.25)", 64).params.reserve == 16
    assert make_policy("adaptive(forget=0.5)", 64).params.forget == 0.5  # not a count of slots
    with pytest.raises(ValueError, match="recent"):
        make_policy("h2o(recent=1.5)", 64)
    assert is_policy_name("adakv(adaptive(horizon=256))") and not is_policy_name("learned(rate=1.0)")
    with pytest.raises(ValueError, match="settings apply to"):
        make_policy("learned(rate=1.0)", 64)


def test_the_table_shows_the_gap_closed_only_when_the_run_can_compute_it():
    from flsmem.harness.evaluate import Row

    def row(policy, budget, nll, gap=float("nan")):
        r = Row(policy, budget, nll, 1.0, [nll])
        r.delta_vs_full, r.gap_closed = nll - 3.0, gap
        return r

    without = format_table([row("full", 64, 3.0), row("h2o", 8, 3.25)], [8], "title").splitlines()
    assert without[3].split() == ["policy", "|", "B=8", "nll", "+full"]
    assert without[5].split() == ["h2o", "|", "3.2500", "+0.2500"]
    rows = [row("full", 64, 3.0), row("streaming_llm", 8, 3.5, 0.0), row("h2o", 8, 3.25, 0.5), row("oracle", 8, 3.0, 1.0)]
    assert format_table(rows, [8], "title").splitlines()[6].split() == ["h2o", "|", "3.2500", "+0.2500", "+0.50"]


def test_argument_checks():
    assert parse_budgets("1/16,1/8,32", 512) == [32, 64, 32]
    with pytest.raises(ValueError, match="budgets"):
        parse_budgets("0", 512)
    with pytest.raises(ValueError, match="budgets"):
        parse_budgets("one", 512)
    with pytest.raises(ValueError, match="windows"):
        cut_windows(np.arange(100), 64, 4, spacing="spread", exact=True)
    with pytest.raises(ValueError, match="policy"):
        make_policy("belady", 32)
    with pytest.raises(ValueError, match="multiple"):
        evaluate_nll(MODEL, WINDOWS, P.h2o(), 8, chunk=5)


def test_flsmem_eval_end_to_end(tmp_path, capsys):
    from flsmem.harness.cli import main

    out = tmp_path / "eval.json"
    plot = tmp_path / "eval.png"
    main(["eval", "--context", "64", "--windows", "2", "--budgets", "1/4", "--policies",
          "streaming_llm,h2o,rmm,oracle", "--json", str(out), "--plot", str(plot)])
    printed = capsys.readouterr().out
    assert "full cache" in printed and "rmm" in printed
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and result["text"] == "persuasion" and result["context"] == 64
    assert {r["policy"] for r in result["rows"]} == {"full", "streaming_llm", "h2o", "rmm", "oracle"}
    assert set(result["rows"][0]) >= {"policy", "budget", "nll", "delta_vs_full", "gap_closed"}
    assert plot.stat().st_size > 10_000


def test_eval_gives_the_learned_policies_the_models_own_estimator(monkeypatch, capsys):
    """``flsmem eval --model smollm2-135m`` hands the learned policies the estimator
    pretrained on SmolLM2's traces; other models get the general one; ``--estimator``
    overrides both. The model and the measuring are stand-ins: only the wiring is tested."""
    from flsmem.harness import evaluate
    from flsmem.harness.cli import main
    from flsmem.models import catalog
    from flsmem.models.data import ByteTokenizer

    given = []

    def record(*args, estimator=None, **kwargs):
        given.append(estimator)
        return [evaluate.Row("full", 64, 1.0, 1.0)]

    monkeypatch.setattr(catalog, "load_tokenizer", lambda name: ByteTokenizer())
    monkeypatch.setattr(catalog, "load", lambda name: (MODEL, ByteTokenizer()))
    monkeypatch.setattr(evaluate, "run_comparison", record)
    common = ["eval", "--policies", "learned", "--context", "64", "--windows", "1", "--plot", ""]
    main(common + ["--model", "smollm2-135m"])
    main(common + ["--model", "tiny"])
    main(common + ["--model", "smollm2-135m", "--estimator", str(evaluate.ESTIMATOR_DIR)])
    capsys.readouterr()
    assert given == [str(evaluate.MODEL_ESTIMATORS["smollm2-135m"]), str(evaluate.ESTIMATOR_DIR),
                     str(evaluate.ESTIMATOR_DIR)]


# ------------------------------------------------- bad arguments of the commands

BAD_ARGUMENTS = {
    "unknown policy": (["eval", "--policies", "h2o,belady"], "--policies"),
    "no policy": (["eval", "--policies", ","], "--policies"),
    "budget 0": (["eval", "--budgets", "0"], "--budgets"),
    "budget above the context": (["eval", "--context", "64", "--budgets", "65"], "--budgets"),
    "budget not a number": (["eval", "--budgets", "one"], "--budgets"),
    "budget over zero": (["eval", "--budgets", "1/0"], "--budgets"),
    "context not a multiple": (["eval", "--context", "100"], "--context"),
    "context 0": (["eval", "--context", "0"], "--context"),
    "evict-every 0": (["eval", "--evict-every", "0"], "--evict-every"),
    "unknown book": (["eval", "--text", "lady-susan"], "--text"),
    "text file missing": (["eval", "--text", "{tmp}/notes.txt"], "--text"),
    "text file empty": (["eval", "--text", "{tmp}/empty.txt"], "--text: {tmp}/empty.txt is empty"),
    "text file binary": (["eval", "--text", "{tmp}/binary.dat"], "--text: {tmp}/binary.dat is not UTF-8 text"),
    "text is a folder": (["eval", "--text", "{tmp}/folder"], "--text: {tmp}/folder is a folder"),
    "text shorter than a window": (["eval", "--text", "{tmp}/short.txt", "--windows", "1", "--context", "64"],
                                   "--windows 1 windows of --context 64 + 1 tokens need 65 tokens, but --text "
                                   "{tmp}/short.txt has 12 tokens of the model's tokenizer"),
    "unknown model": (["eval", "--model", "gpt-2"], "--model"),
    "model file missing": (["eval", "--model", "{tmp}/missing.gguf"], "--model: no GGUF file at {tmp}/missing.gguf"),
    "model file not GGUF": (["eval", "--model", "{tmp}/notes.gguf"], "--model {tmp}/notes.gguf: {tmp}/notes.gguf is not a GGUF"),
    "generate: model file not GGUF": (["generate", "--prompt", "x", "--model", "{tmp}/notes.gguf"],
                                      "--model {tmp}/notes.gguf: {tmp}/notes.gguf is not a GGUF"),
    "unknown correctness": (["eval", "--correctness", "oracle"], "--correctness"),
    "unknown wrapped policy": (["eval", "--policies", "h2o,adakv(nope)"], "--policies"),
    "unknown wrapper": (["eval", "--policies", "twice(h2o)"], "--policies"),
    "unknown policy setting": (["eval", "--policies", "h2o,adaptive(horizn=256)"],
                               "--policies adaptive(horizn=256): policy 'adaptive' has no keyword 'horizn'"),
    "policy setting out of range": (["eval", "--policies", "adaptive(horizon=0)"],
                                    "--policies adaptive(horizon=0): horizon must be an int >= 1"),
    "policy setting not a literal": (["eval", "--policies", "adaptive(horizon=long)"], "--policies"),
    "ruler: unknown policy setting": (["ruler", "--policies", "surprise(reserv=4)", "--out", "{tmp}/r.jsonl"],
                                      "--policies surprise(reserv=4): policy 'surprise' has no keyword 'reserv'"),
    "regime: learned policy with settings": (["regime", "--policies", "learned(rate=1)", "--out", "{tmp}/out"],
                                             "--policies"),
    "regime: policy setting out of range": (["regime", "--policies", "h2o,adaptive(forget=2)", "--out", "{tmp}/out"],
                                            "--policies: policy adaptive(forget=2): forget must"),
    "layer budgets streamed": (["eval", "--policies", "pyramid(h2o)"], "--policies pyramid(h2o): layer budgets apply"),
    "unknown protocol": (["eval", "--protocol", "batch"], "--protocol"),
    "windows 0": (["eval", "--windows", "0"], "--windows"),
    "more windows than the text holds": (["eval", "--windows", "100000"], "--windows"),
    "prefill fraction 1": (["eval", "--prefill-fraction", "1.0"], "--prefill-fraction"),
    "prefill fraction negative": (["eval", "--prefill-fraction", "-0.5"], "--prefill-fraction"),
    "prefill with no prefix": (["eval", "--protocol", "prefill", "--context", "64", "--prefill-fraction", "0.1"],
                               "--prefill-fraction"),
    "estimator missing": (["eval", "--estimator", "{tmp}/no-estimator"], "--estimator"),
    "json in no folder": (["eval", "--json", "{tmp}/missing/rows.json"], "--json"),
    "plot in no folder": (["eval", "--plot", "{tmp}/missing/plot.png"], "--plot"),
    "regime render with nothing saved": (["regime", "--render", "--out", "{tmp}/empty"], "--render"),
    "regime out is a file": (["regime", "--out", "{tmp}/file"], "--out"),
    "learned render with nothing saved": (["learned", "--quick", "--render", "--out", "{tmp}/empty"], "--render"),
    "learned estimator missing": (["learned", "--estimator", "{tmp}/no-estimator", "--out", "{tmp}/out"],
                                  "--estimator"),
    "shift seeds unpaired": (["shift", "--shifted", "{tmp}/a", "--in-family", "{tmp}/a,{tmp}/b", "--out", "{tmp}/out"],
                             "--shifted and --in-family must name the same number"),
    "shift estimator missing": (["shift", "--shifted", "{tmp}/no-estimator", "--in-family", "{tmp}/no-estimator",
                                 "--out", "{tmp}/out"], "--shifted"),
    "shift learning rate not a number": (["shift", "--learning-rates", "fast", "--out", "{tmp}/out"],
                                         "--learning-rates"),
    "shift render with nothing saved": (["shift", "--render", "--out", "{tmp}/empty"], "--render"),
    "shift unknown optimizer": (["shift", "--optimizer", "adam", "--out", "{tmp}/out"],
                                "--optimizer must be one of fresh, pretrained, got 'adam'"),
    "shift unknown family": (["shift", "--family", "gemma", "--out", "{tmp}/out"],
                             "--family must be one of tasks, ruler, got 'gemma'"),
    "shift quick of the ruler family": (["shift", "--family", "ruler", "--quick", "--out", "{tmp}/out"], "--quick"),
    "shift fractions not fractions": (["shift", "--fractions", "half", "--out", "{tmp}/out"], "--fractions"),
    "shift against no run": (["shift", "--against", "{tmp}/folder", "--out", "{tmp}/out"], "--against"),
    "shift against a file that is no run": (["shift", "--against", "{tmp}/run", "--out", "{tmp}/out"], "--against"),
}


@pytest.fixture
def no_models(monkeypatch):
    """Loading a model, or measuring anything, fails the test."""
    from flsmem.harness import regime, shift
    from flsmem.models import catalog

    def forbidden(*args, **kwargs):
        raise AssertionError("a bad argument must stop the command before any model is loaded")

    monkeypatch.setattr(catalog, "load", forbidden)
    monkeypatch.setattr(regime, "run", forbidden)
    monkeypatch.setattr(shift, "run", forbidden)


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_a_bad_argument_is_one_line_and_exit_status_2(case, tmp_path, capsys, no_models):
    from flsmem.harness.cli import main

    argv, name = BAD_ARGUMENTS[case]
    (tmp_path / "file").write_text("not a folder")
    (tmp_path / "empty.txt").write_text(" \n\n")
    (tmp_path / "binary.dat").write_bytes(bytes(range(256)))
    (tmp_path / "short.txt").write_text("Twelve bytes")
    (tmp_path / "folder").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "shift.json").write_text('{"plan": {}}')
    (tmp_path / "notes.gguf").write_text("not a model")
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_:
        main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"flsmem {argv[0]}: error: {name.replace('{tmp}', str(tmp_path))}"), err
    assert "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("command, shown, hidden", [
    ("ruler", ["--samples SAMPLES     samples per task and length (default: 50)", "(default: 1/8,1/4,1/2)"],
     ["--report              measure nothing: write the report from --out ("]),
    ("eval", ["(default: 512)", "(default: flsmem-eval.png)"], ["--json JSON           write the rows as JSON here ("]),
    ("generate", ["(default: h2o)", "(default: 0.0)"], []),
])
def test_help_gives_each_options_default(command, shown, hidden, capsys):
    """``--help`` ends an option's line with its default, except for flags, options
    without one, and help that already says it."""
    from flsmem.harness.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    for expected in shown:
        assert " ".join(expected.split()) in text
    for unexpected in hidden:
        assert " ".join(unexpected.split()) not in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_the_help_formatter_escapes_a_default_and_skips_a_long_one():
    from flsmem.harness.arguments import make_parser

    parser = make_parser("x", "What x does.\n\nHow it does it.")
    parser.add_argument("--share", default="5%", help="a share")
    parser.add_argument("--names", default="a" * 41, help="many names")
    parser.add_argument("--told", default=3, help="three (default: three)")
    text = " ".join(parser.format_help().split())
    assert "a share (default: 5%)" in text
    assert "many names" in text and "a" * 41 not in text
    assert "(default: three)" in text and "(default: 3)" not in text
    assert "What x does." in text and "How it does it." not in text  # the first paragraph only


def test_eval_reads_a_users_text_file_and_standard_input(tmp_path, monkeypatch, capsys):
    """``--text FILE`` and ``--text -`` score the user's own text."""
    import io

    from flsmem.harness.cli import main
    from flsmem.models.data import load_book

    notes = tmp_path / "notes.txt"
    notes.write_text(load_book("northangerabbey")[:4000])
    args = ["eval", "--windows", "1", "--context", "64", "--budgets", "1/4", "--policies", "h2o", "--plot", ""]
    main([*args, "--text", str(notes)])
    from_file = capsys.readouterr().out
    assert "tiny on notes.txt" in from_file and "h2o" in from_file
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(notes.read_bytes())))
    main([*args, "--text", "-"])
    from_stdin = capsys.readouterr().out
    table = lambda out: out.splitlines()[1:]  # noqa: E731 - the title holds the source and the time
    assert table(from_stdin) == table(from_file)


def test_paired_differences_pair_windows():
    from flsmem.harness.paired import _pair, paired_difference, table

    mean, low, high = paired_difference([1.0, 2.0, 3.0], [0.0, 2.0, 1.0])
    assert mean == pytest.approx(1.0) and 0.0 <= low <= mean <= high <= 2.0
    # Equal policies differ by exactly nothing.
    assert paired_difference([1.5, 2.5], [1.5, 2.5]) == (0.0, 0.0, 0.0)
    run = {"rows": [{"policy": "full", "budget": 32, "window_nll": [1.0, 1.0]},
                    {"policy": "adakv(h2o)", "budget": 8, "window_nll": [1.0, 2.0]},
                    {"policy": "h2o", "budget": 8, "window_nll": [1.5, 2.0]}]}
    assert _pair("adakv(h2o)-h2o") == ("adakv(h2o)", "h2o")
    lines = table(run, [("adakv(h2o)", "h2o")]).splitlines()
    assert lines[2].startswith("| adakv(h2o) − h2o | 8 | -0.2500 |") and lines[2].endswith("| 1 of 2 |")


def test_seeds_table_averages_the_seeds_runs_window_by_window(capsys):
    from flsmem.harness.paired import main, seeds_table

    full = {"policy": "full", "budget": 32, "nll": 1.0, "window_nll": [1.0, 1.0]}
    run = {"rows": [full, {"policy": "h2o", "budget": 8, "nll": 1.5, "window_nll": [1.5, 1.5]}]}

    def seed(a, b):
        return {"rows": [full, {"policy": "learned", "budget": 8, "nll": (a + b) / 2, "window_nll": [a, b]}]}

    # Seeds' increases over full: +0.2 and +0.6 (mean 0.4, sd 0.2828); their mean per
    # window is [1.2, 1.6], 0.1 below h2o on average; one seed of two beats h2o.
    line = seeds_table(run, [seed(1.1, 1.3), seed(1.3, 1.9)], [("learned", "h2o")]).splitlines()[2]
    assert line.startswith("| learned − h2o | 8 | +0.2000, +0.6000 | +0.4000 ± 0.2828 | -0.1000 |"), line
    assert line.endswith("| 1 of 2 |")
    other = {"rows": [{**full, "window_nll": [1.0, 1.1]}, seed(1.1, 1.3)["rows"][1]]}
    with pytest.raises(ValueError, match="other windows"):
        seeds_table(run, [other], [("learned", "h2o")])
    # Against another recipe's seeds: their mean per window is [1.3, 1.5] (NLL 1.4).
    line = seeds_table(run, [seed(1.1, 1.3), seed(1.3, 1.9)], [("learned", "learned")],
                       [seed(1.2, 1.4), seed(1.4, 1.6)]).splitlines()[2]
    assert line.startswith("| learned − learned | 8 | +0.2000, +0.6000 | +0.4000 ± 0.2828 | +0.0000 |"), line
    assert line.endswith("| 1 of 2 |")  # 1.2 < 1.4; 1.6 is not
    with pytest.raises(ValueError, match="--against-seeds run 1 holds other windows"):
        seeds_table(run, [seed(1.1, 1.3)], [("learned", "learned")], [other])
    with pytest.raises(SystemExit) as stop:
        main(["run.json", "learned-learned", "--against-seeds", "other.json"])
    assert stop.value.code == 2 and "--against-seeds needs --seeds" in capsys.readouterr().err


def test_join_adds_a_later_runs_policies_on_the_same_windows(tmp_path, capsys):
    from flsmem.harness.paired import join, main

    full = {"policy": "full", "budget": 32, "nll": 1.0, "window_nll": [1.0, 1.0]}
    run = {"rows": [full, {"policy": "h2o", "budget": 8, "nll": 1.5, "window_nll": [1.5, 2.0]}]}
    later = {"rows": [full, {"policy": "rmm", "budget": 8, "nll": 1.25, "window_nll": [1.0, 1.5]}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "later.json").write_text(json.dumps(later))
    main([str(tmp_path / "run.json"), "rmm-h2o", "--join", str(tmp_path / "later.json")])
    # rmm - h2o per window: -0.5 and -0.5.
    assert "| rmm − h2o | 8 | -0.5000 | [-0.5000, -0.5000] | 2 of 2 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="measures h2o at budget 8 again"):
        join(run, [run])
    moved = {"rows": [{**full, "window_nll": [1.0, 1.2]}, later["rows"][1]]}
    with pytest.raises(ValueError, match="other windows"):
        join(run, [moved])
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "run.json"), "rmm-h2o", "--join", str(tmp_path / "moved.json")])
    assert exit_.value.code == 2 and "other windows" in capsys.readouterr().err


def test_ratio_table_divides_by_the_better_reference_at_each_budget(capsys):
    from flsmem.harness.paired import main, ratio_table

    rows = [{"policy": "full", "budget": 32, "nll": 1.0},
            {"policy": "h2o", "budget": 8, "nll": 1.2}, {"policy": "rmm", "budget": 8, "nll": 1.25},
            {"policy": "mix(a=1, b=2)", "budget": 8, "nll": 1.22},
            {"policy": "h2o", "budget": 16, "nll": 1.1}, {"policy": "rmm", "budget": 16, "nll": 1.05},
            {"policy": "mix(a=1, b=2)", "budget": 16, "nll": 1.04}]
    lines = ratio_table({"rows": rows}, ["mix(a=1, b=2)"], ["h2o", "rmm"]).splitlines()
    # At 8 slots h2o's +0.2 is the smaller: 0.22 / 0.2; at 16 rmm's +0.05: 0.04 / 0.05.
    assert lines[2] == "| mix(a=1, b=2) | 8 | +0.2200 | h2o | +0.2000 | 1.10 |"
    assert lines[3] == "| mix(a=1, b=2) | 16 | +0.0400 | rmm | +0.0500 | 0.80 |"
    with pytest.raises(ValueError, match="no tova at budget 8"):
        ratio_table({"rows": rows}, ["tova"], ["h2o"])
    with pytest.raises(SystemExit) as exit_:
        main(["run.json", "mix-h2o", "--ratio-to", "h2o", "--seeds", "a.json"])
    assert exit_.value.code == 2 and "--ratio-to" in capsys.readouterr().err


def test_paired_refuses_a_run_without_a_full_cache_and_a_ratio_of_nothing():
    from flsmem.harness.paired import join, ratio_table

    full = {"policy": "full", "budget": 32, "nll": 1.0, "window_nll": [1.0]}
    run = {"rows": [full, {"policy": "h2o", "budget": 8, "nll": 1.0, "window_nll": [1.0]}]}
    with pytest.raises(ValueError, match="--join run 1: a run has no full-cache row"):
        join(run, [{"rows": []}])
    # h2o is no worse than the full cache here: no increase for a ratio to divide by.
    assert ratio_table(run, ["h2o"], ["h2o"]).splitlines()[2].endswith("| +0.0000 | n/a |")
