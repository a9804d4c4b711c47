"""Command line: ``python -m app.tune`` — Ray Tune sweeps of whole distributed training runs.

Each trial is a Ray Train run of its own world size (the Ray Train V2 pattern: Tune runs a driver
function per trial that builds and fits a TorchTrainer and forwards its reports to Tune), so "how
many workers is worth it" is swept like any other hyperparameter, and the scaling report answers
it with measured numbers.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from app import flags
from app.cli import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    HelpFormatter,
    Parser,
    run_main,
    was_terminated,
)
from app.storage import storage_uri
from app.config import (
    CheckpointConfig,
    DataConfig,
    FaultToleranceConfig,
    LoopConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    UserError,
    WorkersConfig,
    check_name,
)
from app.console import Console

TRAIN_RUNS = "train_runs"
TABLE_FILE = "trials.txt"
SWEEP_FILE = "sweep.json"
"""What the sweep was asked for, kept for --resume and --show."""
SCALING_FILE = "scaling.png"


# --- what runs inside Tune ------------------------------------------------------------------

def _epoch_reports_to_tune():
    from ray.tune.integration.ray_train import TuneReportCallback

    class EpochReportsToTune(TuneReportCallback):
        """Forwards epoch reports only: mid-epoch checkpoints carry no validation metrics."""

        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metrics[0].get("kind") == "epoch":
                super().after_report(run_context, metrics, checkpoint)

    return EpochReportsToTune()


def run_trial(config: dict[str, Any]) -> None:
    """One trial: a whole distributed training run with the trial's world size and config."""
    import ray.tune

    from app import launcher, storage, tracking
    from app.worker import PROGRESS_KEY

    trial_id = ray.tune.get_context().get_trial_id()
    workers = WorkersConfig(
        min_workers=config["num_workers"], max_workers=config["num_workers"],
        use_gpu=config["use_gpu"], cpus_per_worker=config["cpus_per_worker"],
    )
    fault_tolerance = FaultToleranceConfig(
        max_failures=config["max_failures"], placement_timeout_s=config["placement_timeout_s"]
    )
    train_config = TrainConfig.from_dict(config["train"])
    # Named from the trial id: a resumed sweep resumes each trial's own training run.
    run = RunConfig(name=trial_run_name(trial_id), storage_path=config["train_storage"])
    mlflow = tracking.MlflowSettings(**config["mlflow"]) if config.get("mlflow") else None
    console = Console(io.StringIO(), live=False)

    def warn(message: str) -> None:  # in Ray's worker log; on the sweep's console with --verbose
        print(f"warning: {message}", file=sys.stderr, flush=True)

    # A resumed sweep's trial whose driver was killed while Ray rewrote its record.
    resume_from = launcher.recover_snapshot(run, warn) \
        if storage.snapshot_state(run) is storage.Snapshot.UNREADABLE else {}
    tracked = launcher.RunTracking(
        run, console, info=launcher.run_info(train_config),
        params={**launcher.run_params(train_config, workers), "trial_id": trial_id},
        mlflow=mlflow, started=time.time(), warn=warn,
    )
    with tracked.ending():
        # The same watchdog as a single run: a trial whose workers cannot be placed fails with
        # the reason (Tune records it) instead of waiting forever.
        result = launcher.fit_watched(
            lambda progress: launcher.make_trainer(
                train_config, workers, run,
                fault_tolerance=fault_tolerance,
                verbose=False,
                callbacks=[_epoch_reports_to_tune()],
                extra_worker_config={PROGRESS_KEY: progress, **resume_from},
                guard_placement_groups=True,
            ),
            workers, fault_tolerance.placement_timeout_s, console,
        )
        # The trial's metrics.csv, curves and timeline, beside its checkpoints.
        summary = launcher.summarise(result, tracked)
    tracked.finish("finished", summary)


def trial_run_name(trial_id: str) -> str:
    return f"trial-{trial_id}"


# --- the sweep --------------------------------------------------------------------------------

def _parse_list(text: str, kind, flag: str) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{flag} must be a comma-separated list, got {text!r}") from None
    if not values:
        raise UserError(f"{flag} must name at least one value")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m app.tune",
        description=(
            "Ray Tune sweep of a task over learning rate, world size and batch size; every "
            "trial is a whole distributed training run, scored by the task's score (ASHA stops "
            "the trailing ones). Ends with the trials ranked and a scaling report (throughput "
            "and time to a target score against the number of workers)."
        ),
        formatter_class=HelpFormatter,
    )
    space = parser.add_argument_group("search space")
    space.add_argument(
        "--lr-range", default=None, metavar="MIN,MAX",
        help="learning rates sampled log-uniformly from this range [default: the task's lr "
        "/ 10 to x 2; mnist-convnet: 0.05,1.0]",
    )
    space.add_argument(
        "--lr", default=None, metavar="LR[,LR...]",
        help="grid of learning rates to try instead of sampling --lr-range",
    )
    space.add_argument(
        "--num-workers", default="1,2", metavar="N[,N...]", help="world sizes to try (a grid)"
    )
    space.add_argument(
        "--global-batch-size", default=None, metavar="B[,B...]",
        help="global batch sizes to try (a grid) [default: the task's]",
    )
    space.add_argument(
        "--num-samples", type=int, default=2,
        help="learning rates drawn per (world size, batch size) pair (with --lr: repeats)",
    )
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--scheduler", choices=("asha", "fifo"), default="asha",
                       help="asha stops trials whose score trails, per epoch")
    sweep.add_argument(
        "--max-concurrent-trials", type=int, default=None,
        help="trials running at once [default: as many as the cluster can give the largest "
        "world size in the sweep workers at the same time]",
    )
    sweep.add_argument(
        "--target", type=float, default=None,
        help="a value of the task's score whose time-to-reach the scaling report compares "
        "[default: the task's; mnist-convnet: val_accuracy 0.95]",
    )
    sweep.add_argument("--name", default=None, help="sweep name [default: sweep-<time>]")
    sweep.add_argument("--storage-path", default="runs",
                       help="where sweeps are kept (local folder or s3://bucket/prefix)")
    sweep.add_argument("--resume", action="store_true",
                       help="continue the interrupted sweep --name; finished trials are kept")
    sweep.add_argument("--show", action="store_true",
                       help="print the tables of the finished sweep --name and exit")
    training = parser.add_argument_group("training (every trial)")
    flags.add_task_arguments(training)
    training.add_argument("--epochs", type=int, default=None,
                          help="epochs per trial [default: the task's]")
    training.add_argument("--seed", type=int, default=0, help="random seed")
    training.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    training.add_argument("--cpus-per-worker", type=int, default=1, help="CPUs per worker")
    training.add_argument(
        "--placement-timeout", type=float, default=FaultToleranceConfig().placement_timeout_s,
        metavar="SECONDS",
        help="a trial whose workers cannot be placed (or have not run) for this long fails, "
        "saying why, and the sweep goes on",
    )
    flags.add_cluster_arguments(training)
    flags.add_tracking_arguments(parser, "the sweep as a parent run and every trial as its child")
    return parser


def _param_space(args, train_storage: str) -> dict[str, Any]:
    from ray import tune

    train = _template(args, args.data).to_dict()
    train["optim"]["lr"] = tune.grid_search(args.lrs) if args.lrs else \
        tune.loguniform(*args.lr_bounds)
    train["loop"]["global_batch_size"] = tune.grid_search(args.batches)
    return {
        "train": train,
        "num_workers": tune.grid_search(args.world_sizes),
        "use_gpu": args.use_gpu,
        "cpus_per_worker": args.cpus_per_worker,
        "train_storage": train_storage,
        "max_failures": 1,
        "placement_timeout_s": args.placement_timeout,
    }


def _default_concurrency(args, requested: int | None) -> int:
    """``requested``, or as many trials as the cluster can give the largest world size at once;
    a world size the cluster can never host is refused either way."""
    from app import cluster

    largest = WorkersConfig(
        min_workers=max(args.world_sizes), max_workers=max(args.world_sizes),
        use_gpu=args.use_gpu, cpus_per_worker=args.cpus_per_worker,
    )
    cluster.check_capacity(largest)
    if requested is not None:
        if requested < 1:
            raise UserError(f"--max-concurrent-trials must be >= 1, got {requested}")
        return requested
    fits = cluster.workers_that_fit(cluster.live_node_resources(), largest)
    return max(1, fits // max(args.world_sizes))


SWEEP_FLAGS = (
    "task", "lr_range", "lr", "num_workers", "global_batch_size", "num_samples", "scheduler",
    "target", "epochs", "dataset", "data_dir", "seed", "use_gpu", "cpus_per_worker",
)
"""The flags (argparse names) that define a sweep: a --resume must not change them."""


def _check_same_flags(recorded: dict[str, Any], given: dict[str, Any]) -> None:
    changed = [
        f"--{flag.replace('_', '-')} {given[flag]!r} (the sweep has {recorded.get(flag)!r})"
        for flag in SWEEP_FLAGS if flag in given and given[flag] != recorded.get(flag)
    ]
    if changed:
        raise UserError(
            "--resume continues the sweep as it was planned; these flags differ: "
            + "; ".join(changed) + ". Drop them, or start a new sweep under another --name"
        )


def _resolve_task(args) -> None:
    """The task (``args.task``, its reference ``args.task_reference``) and the flags whose
    defaults are the task's."""
    args.task_reference, args.task = flags.resolve_task(args, fill_defaults=False)
    task = args.task
    if args.epochs is None:
        args.epochs = task.epochs
    if args.global_batch_size is None:
        args.global_batch_size = str(task.global_batch_size)
    if args.lr_range is None:
        args.lr_range = f"{task.lr / 10:g},{task.lr * 2:g}"
    if args.target is None:
        args.target = task.target


def _template(args, data: DataConfig) -> TrainConfig:
    """One concrete config of the sweep (its first learning rate, its smallest batch)."""
    return TrainConfig(
        task=args.task_reference,
        data=data,
        optim=OptimConfig(lr=(args.lrs or args.lr_bounds)[0], lr_decay=args.task.lr_decay),
        loop=LoopConfig(epochs=args.epochs, global_batch_size=min(args.batches), seed=args.seed),
        checkpoint=CheckpointConfig(num_to_keep=1),
    )


def _check_grid(args) -> None:
    """The sweep's learning rates and batch sizes, checked before the cluster starts: a bad
    value fails once, now, not in every trial. Each global batch has a sample for every worker
    of the largest world size.

    Sets ``args.lr_bounds``, ``args.lrs`` (None without --lr) and ``args.batches``, the parsed
    lists that the data check and the sweep's grid use."""
    args.lr_bounds = _parse_list(args.lr_range, float, "--lr-range")
    if len(args.lr_bounds) != 2 or not 0 < args.lr_bounds[0] < args.lr_bounds[1]:
        raise UserError(f"--lr-range must be MIN,MAX with 0 < MIN < MAX, got {args.lr_range!r}")
    args.lrs = _parse_list(args.lr, float, "--lr") if args.lr else None
    args.batches = batches = _parse_list(args.global_batch_size, int, "--global-batch-size")
    for value in (args.lrs or []) + batches:
        if value <= 0:
            raise UserError(f"learning rates and batch sizes must be > 0, got {value}")
    _template(args, DataConfig())  # validates the rest of the config
    if min(batches) < max(args.world_sizes):
        raise UserError(
            f"--global-batch-size {min(batches)} is smaller than the {max(args.world_sizes)} "
            "workers of the largest world size: each worker needs a sample per step"
        )


def _check_data(args, embedded: bool, console: Console) -> None:
    """The data as app.train checks it, for every trial at once, before any trial starts."""
    args.data, _ = flags.resolve_data(args, args.task, console, load=embedded,
                                      global_batch_size=max(args.batches))


def _trainable():
    from ray import tune
    from ray.tune.trainable import wrap_function

    from app import timeline

    class Trial(wrap_function(run_trial)):  # named run_trial by Tune, like the function
        """``run_trial``, whose record stays as it is once Tune stops the trial (its scheduler's
        verdict, the sweep's end): Tune leaves the training thread running until the process is
        gone, and that thread's writes would undo the sweep's closing of the record."""

        def cleanup(self):
            timeline.freeze_records()
            super().cleanup()

    # The trial function only drives its Ray Train run, whose workers hold the CPUs and GPUs;
    # it must not take a CPU from them. Tune refuses an empty request, so it asks for memory.
    return tune.with_resources(Trial, {"CPU": 0, "memory": 256 * 1024**2})


def _outcome(result, status: str | None, num_epochs: int, planned: int) -> str:
    """What really happened to a trial, from Tune's status and the trial's error."""
    if result.error is not None:
        from app.failures import find_cause

        cause = find_cause(result.error, (UserError,))
        text = str(cause) if cause is not None else str(result.error)
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        # Ray prefixes a worker's error with its class ("app.config.UserError: ...").
        reason = re.sub(r"^(?:[\w.]+(?:Error|Exception): )+", "", lines[-1]) if lines \
            else type(result.error).__name__
        return f"failed: {reason}"
    if status == "PENDING" or (status is None and num_epochs == 0):
        return "not started"
    if status in ("RUNNING", "PAUSED"):
        return "interrupted"
    return "completed" if num_epochs >= planned else "stopped early by the scheduler"


def _records(result_grid, score: str, mode: str):
    from app.sweep_report import TrialRecord

    # Tune's trial objects carry the status; ResultGrid lists results in the same order.
    trials = getattr(getattr(result_grid, "_experiment_analysis", None), "trials", None)
    trials = trials or [None] * len(result_grid)
    records = []
    for result, trial in zip(result_grid, trials):
        status = trial.status if trial is not None else None
        # A trial that reported nothing (it failed before its first epoch) has its config only
        # on Tune's trial object once the grid is read back from storage.
        config = result.config or (trial.config if trial is not None else None)
        if config is None:
            continue
        frame = result.metrics_dataframe
        rows = [] if frame is None or score not in frame else [
            {key: row[key] for key in ("epoch", score, "samples_per_second",
                                       "time_total_s", "checkpoint_path") if key in row}
            for row in frame.to_dict("records")
        ]
        records.append(TrialRecord(
            trial_id=result.metrics.get("trial_id", Path(result.path).name) if result.metrics
            else Path(result.path).name,
            lr=config["train"]["optim"]["lr"],
            world_size=config["num_workers"],
            global_batch_size=config["train"]["loop"]["global_batch_size"],
            epochs=rows,
            planned_epochs=config["train"]["loop"]["epochs"],
            # The last epoch reached: a resumed trial reports only the epochs it trained since.
            outcome=_outcome(result, status, max((row.get("epoch", 0) for row in rows), default=0),
                             config["train"]["loop"]["epochs"]),
            score=score,
            mode=mode,
        ))
    return records


def report(sweep_uri: str, result_grid, plan: dict[str, Any], console: Console):
    """Print and write the ranked trial table and the scaling report; returns the best trial's
    record."""
    from app import results, sweep_report
    from app.results import format_metric

    score, mode, target = plan["score"], plan["mode"], plan["target"]
    records = _records(result_grid, score, mode)
    if not records:
        raise UserError(f"the sweep in {sweep_uri} has no trial results yet")
    table = sweep_report.trial_table(records)
    rows = sweep_report.scaling(records, target)
    condition = sweep_report.target_text(score, mode, target) if target is not None else None
    scaling_text = sweep_report.scaling_table(rows, condition)
    best = sweep_report.ranked(records)[0]
    best_checkpoint = best.best.get("checkpoint_path") if best.best else None
    results.write_file(f"{sweep_uri}/{TABLE_FILE}", (table + "\n\n" + scaling_text + "\n").encode())
    results.write_file(
        f"{sweep_uri}/{SCALING_FILE}",
        sweep_report.scaling_png(rows, condition, Path(sweep_uri).name),
    )
    console.line()
    console.line(table)
    console.line()
    console.line("Scaling (best trial per world size):")
    console.line(scaling_text)
    console.line()
    best_score = "no results" if best.best_score is None \
        else f"{score} {format_metric(score, best.best_score)}"
    console.line(f"Best trial: {best.trial_id}, {best_score} "
                 f"(lr {best.lr:.4g}, {best.world_size} workers, batch {best.global_batch_size})")
    if best_checkpoint:
        console.line(f"Best checkpoint: {best_checkpoint}")
    console.line(f"Tables:  {sweep_uri}/{TABLE_FILE}")
    console.line(f"Scaling: {sweep_uri}/{SCALING_FILE}")
    return best


def _run(args, console: Console) -> int:
    from app import cluster, results, storage

    args.world_sizes = _parse_list(args.num_workers, int, "--num-workers")
    if min(args.world_sizes) < 1:
        raise UserError("--num-workers values must be >= 1")
    if args.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1, got {args.num_samples}")
    FaultToleranceConfig(placement_timeout_s=args.placement_timeout)  # validates it
    if (args.resume or args.show) and not args.name:
        raise UserError("--resume and --show need the --name of the sweep")
    storage_root = storage_uri(args.storage_path)
    name = check_name(args.name, "sweep name") if args.name else \
        f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    sweep_uri = storage.join(storage_root, name)
    storage.check_storage(storage_root)
    if not args.resume and not args.show:
        _resolve_task(args)
        _check_grid(args)
        flags.check_data_flags(args, args.task)

    from app import tracking

    mlflow = None if args.show else \
        tracking.mlflow_settings(args.mlflow_uri, args.mlflow_experiment)
    sweep_run = None
    # Every check that needs no data has passed: the cluster starts now, beside the data's
    # load, the task's check on its samples and the sweep's imports.
    with cluster.Connecting(args.address, verbose=args.verbose) as connection:
        if not args.resume and not args.show:
            _check_data(args, embedded=not args.address, console=console)
        from ray import tune

        from app import sweep_console

        connection.wait()
        if args.show or args.resume:
            if not tune.Tuner.can_restore(sweep_uri):
                raise UserError(f"no sweep named {name!r} in {storage_root}")
            # Before Tune unpickles the folder's experiment state: only a sweep of this app's.
            try:
                plan = json.loads(results.read_file(f"{sweep_uri}/{SWEEP_FILE}"))
                recorded = plan["flags"]
            except (OSError, ValueError, KeyError, TypeError):
                raise UserError(
                    f"{sweep_uri} was not made by this version of app.tune (no valid "
                    f"{SWEEP_FILE}); refusing to load its Ray Tune state"
                ) from None
            if args.resume:
                _check_same_flags(recorded, args.explicit_flags)
            tuner = tune.Tuner.restore(
                sweep_uri, trainable=_trainable(), resume_unfinished=True, resume_errored=True
            )
            if args.show:
                report(sweep_uri, tuner.get_results(), plan, console)
                return 0
            if mlflow is not None:
                sweep_run = tracking.SweepRun(mlflow, sweep_uri, name, plan["flags"], console)
        else:
            if tune.Tuner.can_restore(sweep_uri):
                raise UserError(
                    f"a sweep named {name!r} exists in {storage_root}: add --resume to continue "
                    "it, --show to see it, or choose another --name"
                )
            concurrency = _default_concurrency(args, args.max_concurrent_trials)
            num_lrs = len(args.lrs) if args.lrs else 1
            num_batches = len(args.batches)
            plan = {
                "num_trials": args.num_samples * num_lrs * num_batches * len(args.world_sizes),
                "score": args.task.score,
                "mode": args.task.score_mode,
                "target": args.target,
                # What defines the sweep, for a --resume to compare; never --address or
                # --storage-path, which may carry credentials.
                "flags": {flag: getattr(args, flag) for flag in SWEEP_FLAGS} | {
                    "task": args.task_reference},
            }
            scheduler = (
                tune.schedulers.ASHAScheduler(
                    time_attr="epoch", max_t=args.epochs, grace_period=1, reduction_factor=2
                ) if args.scheduler == "asha" else tune.schedulers.FIFOScheduler()
            )
            if mlflow is not None:
                sweep_run = tracking.SweepRun(mlflow, sweep_uri, name, plan["flags"], console)
            param_space = _param_space(args, f"{sweep_uri}/{TRAIN_RUNS}")
            param_space["mlflow"] = sweep_run.child_settings() if sweep_run else None
            tuner = tune.Tuner(
                _trainable(),
                param_space=param_space,
                tune_config=tune.TuneConfig(
                    metric=args.task.score, mode=args.task.score_mode, scheduler=scheduler,
                    num_samples=args.num_samples, max_concurrent_trials=concurrency,
                    # A stopped trial's actor must go: a reused one keeps the stopped trial's
                    # Train controller alive, holding its workers' placement group.
                    reuse_actors=False,
                ),
                # The sweep's own lines (sweep_console); Tune's status tables with --verbose.
                run_config=tune.RunConfig(
                    name=name, storage_path=storage_root, verbose=2 if args.verbose else 0,
                    callbacks=[sweep_console.SweepCallback()],
                ),
            )
            # Tune keeps pickled state here, which --resume and --show load: owner-only.
            storage.make_private(sweep_uri)
            results.write_file(f"{sweep_uri}/{SWEEP_FILE}", json.dumps(plan).encode())
            console.line(
                f"Sweep {name}: {plan['num_trials']} trials of {args.task.name} (world sizes "
                f"{', '.join(map(str, args.world_sizes))}; "
                f"{'lr ' + args.lr if args.lr else 'lr sampled in ' + args.lr_range}; "
                f"{args.epochs} epochs each, {args.scheduler}), up to {concurrency} at a time; "
                f"results in {sweep_uri}")
        if sweep_run is not None and sweep_run.client is not None:
            console.line(f"MLflow: {sweep_run.link} (a child run per trial)")
        if not args.verbose:
            # Tune's new output engine prints its configuration box and a TensorBoard hint even
            # at verbose=0; the legacy engine at verbose=0 prints nothing.
            os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
        trials_console = sweep_console.SweepConsole(
            console, plan["score"], plan["mode"], f"{sweep_uri}/{TRAIN_RUNS}",
            mlflow_on=mlflow is not None)
        sweep_console.activate(trials_console)
        tuner.fit()
        sweep_console.activate(None)
        trials_console.close_records()
        # The statuses as Tune saved them, not the returned grid's: on Ctrl-C Tune saves the
        # experiment, then stops the running trials and marks them TERMINATED in memory, which
        # would count an interrupted trial as finished.
        result_grid = tune.Tuner.restore(sweep_uri, trainable=_trainable()).get_results()
        best = report(sweep_uri, result_grid, plan, console)
        finished = result_grid.num_terminated + result_grid.num_errors
        if sweep_run is not None:
            sweep_run.finish(
                "FINISHED" if finished == plan["num_trials"] else "KILLED",
                best={f"best_{plan['score']}": best.best_score} if best.best_score is not None
                else {},
                tags={"best_trial": best.trial_id,
                      **({"best_checkpoint": best.best["checkpoint_path"]}
                         if best.best and best.best.get("checkpoint_path") else {})},
                artifacts=[f"{sweep_uri}/{TABLE_FILE}", f"{sweep_uri}/{SCALING_FILE}"],
            )
        if finished < plan["num_trials"]:
            # Tune stops gracefully on Ctrl-C (and SIGTERM) and returns what it has.
            how, code = ("terminated", EXIT_TERMINATED) if was_terminated() \
                else ("interrupted", EXIT_INTERRUPTED)
            print(
                f"{how}: {finished} of {plan['num_trials']} trials finished; rerun with "
                f"--name {name} --resume to complete the sweep",
                file=sys.stderr, flush=True,
            )
            return code
        if result_grid.num_errors:
            print(f"error: {result_grid.num_errors} trial(s) failed; their logs are under "
                  f"{sweep_uri}", file=sys.stderr, flush=True)
            return 1
    return 0


def _explicit_flags(argv: list[str] | None) -> dict[str, Any]:
    """The flags given on the command line (not their defaults), by argparse name."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    return vars(parser.parse_known_args(argv)[0])


def main(argv: list[str] | None = None) -> int:
    def run(args, console: Console) -> int:
        # Parsed again only once the real parse succeeded (so --help is never handled twice).
        args.explicit_flags = _explicit_flags(argv)
        return _run(args, console)

    return run_main(
        build_parser(), run, argv,
        interrupted="finished trials are kept; rerun with --name NAME --resume to continue",
    )


if __name__ == "__main__":
    sys.exit(main())
