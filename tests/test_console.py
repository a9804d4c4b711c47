"""What a person sees: the epoch table's columns follow the task's metrics; --verbose says where
a start's seconds went."""

import io

from app.console import Console


def _start(**extra):
    return {"event": "start", "device": "cpu", "resumed_at_epoch": None, "epochs": 3,
            "world_size": 2, "task": "diabetes", "dataset": "diabetes", "num_train": 354,
            "num_val": 88, "batch_per_worker": 16, "precision": "fp32", "metrics": ["val_mae"],
            "time": 110.0, **extra}


def test_one_column_per_metric_of_the_task():
    console = Console(io.StringIO())
    console.handle(_start())
    console.handle({"event": "epoch", "epoch": 1, "world_size": 2, "train_loss": 0.9,
                    "val_loss": 0.5, "val_mae": 0.61234, "samples_per_second": 5000.0,
                    "epoch_seconds": 0.1})
    lines = console.stream.getvalue().splitlines()
    assert lines[0].startswith("Training diabetes: 354 train / 88 validation samples")
    assert lines[1].split() == ["epoch", "workers", "train", "loss", "val", "loss", "val", "mae",
                                "samples/s", "seconds"]
    assert lines[2].split() == ["1", "2", "0.9000", "0.5000", "0.6123", "5,000", "0.1"]


def test_verbose_start_timings_say_where_the_seconds_went():
    quiet = Console(io.StringIO())
    quiet.handle(_start(phases={"worker_entry": 104.0, "data_loaded": 105.5,
                                "model_ready": 107.0}))
    assert "Start:" not in quiet.stream.getvalue()
    verbose = Console(io.StringIO())
    verbose.launched = 100.0
    verbose.handle(_start(phases={"worker_entry": 104.0, "data_loaded": 105.5,
                                  "model_ready": 107.0}))
    assert ("Start: workers running 4.0 s after launch; data 1.5 s; model and process group "
            "1.5 s; first step at 10.0 s.") in verbose.stream.getvalue()
