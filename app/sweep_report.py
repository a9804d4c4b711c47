"""A finished sweep, summarised: the ranked trial table and the scaling report (throughput and
time to a target accuracy against world size). Pure functions on plain records; no Ray."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrialRecord:
    trial_id: str
    lr: float
    world_size: int
    global_batch_size: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    """Per-epoch metrics as reported to Tune (val_accuracy, samples_per_second, time_total_s)."""
    planned_epochs: int = 0
    outcome: str = ""
    """What happened to the trial, as the table says it ("completed", "stopped early by ASHA",
    "failed: <reason>", "not started", "interrupted"); derived from the epochs when empty."""
    score: str = "val_accuracy"
    """The task's score: the metric that ranks epochs and trials."""
    mode: str = "max"
    """"max" when a higher score is better, "min" when lower is."""

    def _key(self, value: float) -> float:
        return value if self.mode == "max" else -value

    @property
    def best(self) -> dict[str, Any] | None:
        rows = [row for row in self.epochs if self.score in row]
        return max(rows, key=lambda row: self._key(row[self.score])) if rows else None

    @property
    def best_score(self) -> float | None:
        return self.best[self.score] if self.best else None

    @property
    def rank_key(self) -> float:
        """Larger is better, whatever the mode; a trial without results ranks last."""
        return self._key(self.best_score) if self.best is not None else float("-inf")

    @property
    def throughput(self) -> float:
        """Steady samples/s: the median over epochs after the first, which pays the warm-up."""
        rates = [row["samples_per_second"] for row in self.epochs]
        steady = rates[1:] or rates
        return statistics.median(steady) if steady else 0.0

    @property
    def status(self) -> str:
        if self.outcome:
            return self.outcome
        return "stopped early" if len(self.epochs) < self.planned_epochs else "completed"

    def time_to(self, target: float) -> float | None:
        """Seconds of the trial until its score first reached ``target``."""
        for row in self.epochs:
            if self.score in row and self._key(row[self.score]) >= self._key(target):
                return row["time_total_s"]
        return None


def ranked(trials: list[TrialRecord]) -> list[TrialRecord]:
    return sorted(trials, key=lambda trial: trial.rank_key, reverse=True)


def _score_text(name: str, value: float | None) -> str:
    from app.results import format_metric

    return "-" if value is None else format_metric(name, value)


def target_text(score: str, mode: str, target: float) -> str:
    """'val_accuracy >= 95.00%', the condition a sweep times each world size to."""
    return f"{score} {'>=' if mode == 'max' else '<='} {_score_text(score, target)}"


def trial_table(trials: list[TrialRecord]) -> str:
    score = trials[0].score if trials else "val_accuracy"
    title = "best " + score.removeprefix("val_").replace("accuracy", "acc").replace("_", " ")
    width = max(9, len(title))
    lines = [
        f"{'rank':>4}  {'trial':<12} {'lr':>9} {'workers':>7} {'batch':>6} {title:>{width}} "
        f"{'epoch':>5} {'samples/s':>10} {'time to best':>13}  status"
    ]
    for position, trial in enumerate(ranked(trials), start=1):
        best = trial.best
        status = trial.status if len(trial.status) <= 110 else trial.status[:109] + "…"
        to_best = f"{best['time_total_s']:.1f} s" if best else "-"
        lines.append(
            f"{position:>4}  {trial.trial_id:<12} {trial.lr:>9.4g} {trial.world_size:>7} "
            f"{trial.global_batch_size:>6} {_score_text(trial.score, trial.best_score):>{width}} "
            f"{best['epoch'] if best else '-':>5} {trial.throughput:>10,.0f} "
            f"{to_best:>13}  {status}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ScalingRow:
    world_size: int
    throughput: float
    """Best steady samples/s among the trials of this world size."""
    efficiency: float | None
    """throughput / (world_size x throughput at world size 1); None without a size-1 trial."""
    time_to_target: float | None
    """Fastest time to the target score among the trials of this world size (None: not
    reached, or no target)."""


def scaling(trials: list[TrialRecord], target: float | None) -> list[ScalingRow]:
    sizes = sorted({trial.world_size for trial in trials})
    throughput = {
        size: max(t.throughput for t in trials if t.world_size == size) for size in sizes
    }
    rows = []
    for size in sizes:
        times = [t.time_to(target) for t in trials if t.world_size == size] \
            if target is not None else []
        reached = [seconds for seconds in times if seconds is not None]
        base = throughput.get(1)
        rows.append(
            ScalingRow(
                world_size=size,
                throughput=throughput[size],
                efficiency=throughput[size] / (size * base) if base else None,
                time_to_target=min(reached) if reached else None,
            )
        )
    return rows


def scaling_table(rows: list[ScalingRow], target: str | None) -> str:
    """``target``: the condition timed (``target_text``), or None when the sweep has none."""
    heading = f"time to {target}" if target else "time to target"
    width = max(16, len(heading))
    lines = [f"{'workers':>7} {'samples/s':>10} {'efficiency':>10} {heading:>{width}}"]
    for row in rows:
        efficiency = f"{100 * row.efficiency:.0f}%" if row.efficiency is not None else "-"
        reached = f"{row.time_to_target:.1f} s" if row.time_to_target is not None \
            else "not reached" if target else "-"
        lines.append(
            f"{row.world_size:>7} {row.throughput:>10,.0f} {efficiency:>10} {reached:>{width}}"
        )
    return "\n".join(lines)


def scaling_png(rows: list[ScalingRow], target: str | None, title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    from app.results import png_bytes

    sizes = [row.world_size for row in rows]
    figure, (throughput_axes, time_axes) = pyplot.subplots(1, 2, figsize=(10, 4))
    throughput_axes.plot(sizes, [row.throughput for row in rows], "o-", label="measured")
    if rows and rows[0].world_size == 1:
        ideal = [rows[0].throughput * size for size in sizes]
        throughput_axes.plot(sizes, ideal, "--", color="grey", label="linear scaling")
    throughput_axes.set(xlabel="workers", ylabel="samples/s", title="Throughput")
    throughput_axes.legend()
    reached = [row for row in rows if row.time_to_target is not None]
    time_axes.plot(
        [row.world_size for row in reached], [row.time_to_target for row in reached], "o-"
    )
    time_axes.set(
        xlabel="workers", ylabel="seconds",
        title=f"Time to {target}" if target else "Time to target (none set)",
    )
    for axes in (throughput_axes, time_axes):
        axes.grid(alpha=0.3)
        axes.set_xticks(sizes)
    return png_bytes(figure, title)
