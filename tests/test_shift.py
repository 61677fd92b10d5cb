"""The shift experiment: a stream of requests carries what the estimator learns, and the
share of the gap recovered is computed as defined."""

import dataclasses

import numpy as np
import pytest

from flsmem import estimator as E
from flsmem.harness import regime, shift
from flsmem.harness.evaluate import ESTIMATOR_DIR, evaluate_windows


def test_a_stream_of_requests_carries_what_the_estimator_learns():
    model = regime.tasks_model()
    plan = dataclasses.replace(regime.QUICK, tasks=("repeat",), seeds=(0,), examples=4, task_context=128)
    windows = regime.task_setting("repeat", plan, model).windows
    start = shift._start(str(ESTIMATOR_DIR))
    frozen = E.from_checkpoint(ESTIMATOR_DIR, online=False, recent=8)
    online = E.from_checkpoint(ESTIMATOR_DIR, online=True, learning_rate=1e-2, recent=8)
    # Frozen, requests are independent: two of two windows give what one of four gives
    # (to rounding: another batch size sums in another order, which may flip an argmax tie).
    nll, hit, updates = shift.stream(model, windows, frozen, 16, start, batch=2)
    whole_nll, whole_hit, _ = evaluate_windows(model, windows, frozen, 16, chunk=shift.CHUNK, aux=start)
    np.testing.assert_allclose(nll, whole_nll, rtol=1e-5, atol=1e-5)
    assert updates == 0 and (hit == whole_hit).mean() > 0.99
    # Learning, the first request is served by the start (the 256-query horizon matures
    # nothing inside a 128-token window); each request's end takes one step, and the
    # second request is served by what the first taught.
    learned_nll, _, learned_updates = shift.stream(model, windows, online, 16, start, batch=2)
    assert learned_updates == 2
    np.testing.assert_allclose(learned_nll[:2], nll[:2], rtol=1e-5, atol=1e-5)
    assert not np.allclose(learned_nll[2:], nll[2:], rtol=0, atol=1e-6)


def test_a_pretrained_optimizer_needs_checkpoints_that_saved_one(tmp_path):
    with pytest.raises(ValueError, match="--optimizer pretrained needs checkpoints saved with their optimizer"):
        shift.ShiftPlan((str(ESTIMATOR_DIR),), (str(ESTIMATOR_DIR),), optimizer="pretrained")
    plan = shift.ShiftPlan((str(ESTIMATOR_DIR),), (str(ESTIMATOR_DIR),))
    assert plan.optimizer == "fresh"


def _rows(values):
    """Rows of one task and budget from ``{(family, rate): [per-example values per seed]}``."""
    return [{"task": "repeat", "fraction": 0.125, "budget": 32, "estimator": family, "learning_rate": rate,
             "pretraining": seed, "updates": 0, "value": float(np.mean(v)), "per_example": v}
            for (family, rate), per_seed in values.items() for seed, v in enumerate(per_seed)]


def test_gap_recovered_by_hand():
    rows = _rows({
        ("shifted", None): [[0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]],
        ("shifted", 0.01): [[0.5, 0.0, 0.5, 0.5], [1.0, 0.5, 0.5, 0.5]],
        ("in_family", None): [[1.0, 0.0, 0.5, 0.5], [1.0, 1.0, 0.5, 0.5]],
    })
    got = shift.recovered(rows, 0.01)
    # Each seed: gain 0.5 / 4 examples, gap 1.0 / 4, so half the gap is recovered.
    assert got["per_seed"] == pytest.approx([0.5, 0.5])
    assert got["gain"][0] == pytest.approx(0.125) and got["gap"][0] == pytest.approx(0.25)
    assert got["ratio"][0] == pytest.approx(0.5)
    # Per example, over seeds, the gap is (0.75, 0.25, 0, 0): a resample of the last two
    # alone (1 in 16) has none, so the interval reaches 0.
    assert got["gap"][1] == 0 and got["gap"][2] > 0.25
    text = shift.format_report(rows)
    assert "| repeat | 32 (1/8) | 0.375 ± 0.177 | 0.500 ± 0.177 | 0.625 ± 0.177 |" in text, text
    assert "FAILS  online 0.01 recovers +0.50 of the gap (goal >= 0.5); no measurable gap" in text, text


def test_a_run_against_another_by_hand():
    frozen = {("shifted", None): [[0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]],
              ("in_family", None): [[1.0, 0.0, 0.5, 0.5], [1.0, 1.0, 0.5, 0.5]]}
    base = _rows(frozen | {("shifted", 0.01): [[0.5, 0.0, 0.5, 0.5], [1.0, 0.5, 0.5, 0.5]],
                           ("in_family", 0.01): [[1.0, 0.0, 0.5, 0.5], [1.0, 1.0, 0.5, 0.5]]})
    rows = _rows(frozen | {("shifted", 0.01): [[0.5, 0.0, 0.5, 1.0], [1.0, 0.5, 0.5, 1.0]],
                           ("in_family", 0.01): [[0.0, 0.0, 0.5, 0.5], [1.0, 1.0, 0.5, 0.5]]})
    got = {(c["family"], c["half"]): c["difference"] for c in shift.against(rows, base)}
    # shifted: +0.5 on the last example of both seeds, 1/8 of the stream's mean, all in its second half.
    assert got[("shifted", "whole")][0] == pytest.approx(0.125)
    assert got[("shifted", "first")] == pytest.approx((0.0, 0.0, 0.0))
    assert got[("shifted", "second")][0] == pytest.approx(0.25)
    # in_family: -1 on the first example of one seed: -1/8 over the stream, -1/4 in the first half.
    assert got[("in_family", "whole")][0] == pytest.approx(-0.125)
    assert got[("in_family", "first")][0] == pytest.approx(-0.25)
    assert got[("in_family", "second")] == pytest.approx((0.0, 0.0, 0.0))
    low, high = got[("in_family", "whole")][1:]
    assert -0.5 <= low < -0.125 < high <= 0.0  # resampling the one example that moved, 0 to 4 times
    table = shift.format_against(shift.against(rows, base), "other")
    assert "| shifted online 0.01 | +0.125 [" in table and "| +0.000 [+0.000, +0.000] |" in table, table
    moved = _rows(frozen | {("shifted", None): [[0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 0.5, 0.0]]})
    with pytest.raises(ValueError, match="--against must name a run on the same examples"):
        shift.against(rows, moved + [r for r in base if r["learning_rate"] is not None])


def test_one_stream_of_every_task_in_turns_or_one_after_another():
    # Shares of two windows: each request of 6 holds two of each task, in their order.
    order = shift._stream_order(tasks=3, windows=4, share=2)
    np.testing.assert_array_equal(order, [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]])
    np.testing.assert_array_equal(shift._stream_order(tasks=2, windows=3, share=3), [[0, 1, 2], [3, 4, 5]])
    with pytest.raises(ValueError, match="--order interleaved needs --batch a multiple of the 4 tasks"):
        shift.ShiftPlan((str(ESTIMATOR_DIR),), (str(ESTIMATOR_DIR),), batch=6, order="interleaved")
    with pytest.raises(ValueError, match="--order must be one of per-task, sequential, interleaved"):
        shift.ShiftPlan((str(ESTIMATOR_DIR),), (str(ESTIMATOR_DIR),), order="mixed")


def test_the_ruler_family_has_its_own_plan_and_refuses_tasks_of_another():
    import argparse

    parser = argparse.ArgumentParser()
    shift.add_arguments(parser)
    estimator = str(ESTIMATOR_DIR)
    given = ["--family", "ruler", "--shifted", estimator, "--in-family", estimator]
    plan = shift._plan(parser.parse_args(given))
    assert (plan.family, plan.tasks, plan.fractions, plan.order) == (
        "ruler", shift.RULER["tasks"], shift.RULER["fractions"], "interleaved")
    plan = shift._plan(parser.parse_args(given + ["--order", "per-task", "--fractions", "1/4,1/2",
                                                  "--tasks", "niah_single_1"]))
    assert (plan.tasks, plan.fractions, plan.order) == (("niah_single_1",), (0.25, 0.5), "per-task")
    with pytest.raises(ValueError, match="--tasks must be among niah_single_1, .* for --family ruler, got passkey"):
        shift.ShiftPlan((estimator,), (estimator,), family="ruler", tasks=("passkey",))


def test_the_ruler_family_serves_smollm2_teacher_forced_needle_tasks():
    from real_models import real_model_file

    from flsmem.models import smollm2

    real_model_file(smollm2.gguf_path)
    plan = shift.ShiftPlan((str(ESTIMATOR_DIR),), (str(ESTIMATOR_DIR),), family="ruler",
                           tasks=("niah_single_2",), seeds=(0, 1), examples=2, batch=2)
    _, tasks = shift.target_tasks(plan)
    task = tasks["niah_single_2"]
    assert task.windows.shape == (4, 257) and task.context == 256
    # The examples of each seed in turn, and the gold answer scores 1 where it is predicted.
    _, tokenizer = smollm2.load_smollm2()
    from flsmem.harness.ruler.forced import forced_batch

    second = forced_batch("niah_single_2", 256, 2, tokenizer, seed=1)
    np.testing.assert_array_equal(task.windows[2:], second.tokens)
    hit = np.zeros((4, 256), bool)
    hit[2:] = second.answer
    np.testing.assert_array_equal(task.score(None, hit), [0.0, 0.0, 1.0, 1.0])


def test_reference_policies_are_reported_beside_the_estimators():
    rows = _rows({("shifted", None): [[0.0, 0.5]], ("in_family", None): [[1.0, 0.5]], ("shifted", 0.01): [[0.5, 0.5]]})
    reference_rows = [{"task": "repeat", "fraction": 0.125, "budget": 32, "policy": name, "value": value,
                       "per_example": [value, value]} for name, value in (("full", 1.0), ("h2o", 0.25))]
    text = shift.format_report(rows, reference_rows)
    assert "| task | budget | full | h2o |" in text and "| repeat | 32 (1/8) | 1.000 | 0.250 |" in text
    assert "other policies" not in shift.format_report(rows)
    with pytest.raises(ValueError, match="references must be policy names"):
        shift.ShiftPlan((str(ESTIMATOR_DIR),), (str(ESTIMATOR_DIR),), references=("h2o", "nonsense"))


def test_no_ratio_is_printed_for_a_gap_of_zero_or_below():
    rows = _rows({("shifted", None): [[0.5, 0.0], [0.0, 0.0]], ("shifted", 0.01): [[0.0, 0.0], [0.0, 0.0]],
                  ("in_family", None): [[0.0, 0.0], [0.0, 0.0]]})
    text = shift.format_report(rows)
    assert "| n/a: no gap | n/a, n/a | n/a |" in text, text
    assert "FAILS  online 0.01: no gap to recover (in_family - offline is -0.1250; goal >= 0.5 of it)" in text, text


def test_a_render_names_the_family_tasks_and_budgets_it_ran(tmp_path):
    import json

    rows = _rows({("shifted", None): [[0.0, 0.5]], ("shifted", 0.01): [[0.5, 0.5]], ("in_family", None): [[1.0, 0.5]]})
    plan = {"family": "ruler", "order": "interleaved", "batch": 8, "optimizer": "fresh",
            "tasks": ["niah_single_1"], "fractions": [0.25]}
    (tmp_path / "shift.json").write_text(json.dumps({"plan": plan, "seconds": 12.0, "rows": rows}))
    shift.main(["--render", "--out", str(tmp_path)])
    first = (tmp_path / "shift.txt").read_text().splitlines()[0]
    assert first == "flsmem shift --family ruler --order interleaved --tasks niah_single_1 --fractions 1/4 (12 s)"


def test_a_run_loads_the_target_model_and_examples_once_for_the_estimators_and_the_references(tmp_path, monkeypatch):
    loaded, given = [], []
    monkeypatch.setattr(shift, "target_tasks", lambda plan: loaded.append(plan) or ("model", {"task": "examples"}))
    monkeypatch.setattr(shift, "run", lambda plan, targets=None: given.append(targets) or [])
    monkeypatch.setattr(shift, "references", lambda plan, targets=None: given.append(targets) or [])
    monkeypatch.setattr(shift, "format_report", lambda rows, reference_rows=(): "report")
    shift.main(["--quick", "--out", str(tmp_path)])
    assert len(loaded) == 1 and given == [("model", {"task": "examples"})] * 2
