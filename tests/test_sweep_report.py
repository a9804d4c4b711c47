import pytest

from app.sweep_report import (
    TrialRecord,
    ranked,
    scaling,
    scaling_png,
    scaling_table,
    target_text,
    trial_table,
)


def _trial(trial_id, lr, world_size, accuracies, rate, seconds_per_epoch, planned=3):
    epochs = [
        {"epoch": i + 1, "val_accuracy": accuracy, "samples_per_second": rate * (0.5 if i == 0 else 1),
         "time_total_s": seconds_per_epoch * (i + 1)}
        for i, accuracy in enumerate(accuracies)
    ]
    return TrialRecord(trial_id, lr, world_size, 128, epochs, planned_epochs=planned)


TRIALS = [
    _trial("a", 0.5, 1, [0.90, 0.96, 0.97], rate=1000, seconds_per_epoch=10),
    _trial("b", 0.001, 1, [0.40], rate=1000, seconds_per_epoch=10),
    _trial("c", 0.5, 2, [0.91, 0.97, 0.98], rate=1600, seconds_per_epoch=6),
    _trial("d", 0.3, 4, [0.85, 0.93, 0.95], rate=2400, seconds_per_epoch=4),
]


def test_ranking_and_table():
    assert [t.trial_id for t in ranked(TRIALS)] == ["c", "a", "d", "b"]
    table = trial_table(TRIALS).splitlines()
    assert table[1].split()[1] == "c" and "98.00%" in table[1] and "completed" in table[1]
    assert "stopped early" in table[-1]
    assert TRIALS[0].throughput == 1000  # the warm-up epoch is left out


def test_scaling_efficiency_and_time_to_target():
    rows = scaling(TRIALS, target=0.95)
    assert [row.world_size for row in rows] == [1, 2, 4]
    assert rows[0].efficiency == pytest.approx(1.0)
    assert rows[1].efficiency == pytest.approx(1600 / 2000)
    assert rows[2].efficiency == pytest.approx(2400 / 4000)
    assert [row.time_to_target for row in rows] == [20, 12, 12]
    assert scaling(TRIALS, target=0.99)[0].time_to_target is None
    condition = target_text("val_accuracy", "max", 0.95)
    text = scaling_table(rows, condition)
    assert "80%" in text and "time to val_accuracy >= 95.00%" in text
    assert scaling_png(rows, condition, "sweep")[:4] == b"\x89PNG"
    assert scaling(TRIALS, target=None)[0].time_to_target is None
    assert "not reached" not in scaling_table(rows, None)


def test_a_lower_is_better_score_ranks_and_times_the_other_way():
    def trial(trial_id, losses):
        epochs = [{"epoch": i + 1, "val_loss": loss, "samples_per_second": 100.0,
                   "time_total_s": 10.0 * (i + 1)} for i, loss in enumerate(losses)]
        return TrialRecord(trial_id, 0.1, 1, 32, epochs, planned_epochs=3, score="val_loss",
                           mode="min")

    trials = [trial("high", [0.9, 0.8, 0.7]), trial("low", [0.8, 0.3, 0.5]), trial("none", [])]
    assert [t.trial_id for t in ranked(trials)] == ["low", "high", "none"]
    assert trials[1].best["epoch"] == 2 and trials[1].best_score == 0.3
    assert trials[1].time_to(0.4) == 20.0 and trials[0].time_to(0.4) is None
    assert "best loss" in trial_table(trials) and "0.3000" in trial_table(trials)
