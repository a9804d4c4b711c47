import pytest

from app.config import (
    CheckpointConfig,
    DataConfig,
    LoopConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    UserError,
    WorkersConfig,
    parse_worker_range,
)


def test_round_trip_through_plain_dict():
    config = TrainConfig(
        task="/home/me/my_task.py:task",
        data=DataConfig(dataset="fashion-mnist", data_dir="/d"),
        optim=OptimConfig(lr=0.1),
        loop=LoopConfig(epochs=3, global_batch_size=256, seed=7, precision="bf16"),
        checkpoint=CheckpointConfig(num_to_keep=2),
    )
    values = config.to_dict()
    assert values["loop"]["global_batch_size"] == 256
    assert TrainConfig.from_dict(values) == config


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataConfig(data_dir=""),
        lambda: OptimConfig(lr=0),
        lambda: OptimConfig(lr_decay=1.5),
        lambda: LoopConfig(epochs=0),
        lambda: LoopConfig(global_batch_size=0),
        lambda: LoopConfig(precision="fp8"),
        lambda: CheckpointConfig(num_to_keep=0),
        lambda: WorkersConfig(min_workers=0, max_workers=0),
        lambda: WorkersConfig(min_workers=3, max_workers=2),
        lambda: WorkersConfig(cpus_per_worker=0),
        lambda: RunConfig(name="../escape", storage_path="/tmp"),
        lambda: RunConfig(name="", storage_path="/tmp"),
    ],
)
def test_invalid_values_are_user_errors(make):
    with pytest.raises(UserError):
        make()


def test_worker_range():
    assert parse_worker_range("4") == (4, 4)
    assert parse_worker_range("2-8") == (2, 8)
    assert WorkersConfig(min_workers=2, max_workers=8).is_elastic
    assert not WorkersConfig(min_workers=2, max_workers=2).is_elastic
    for bad in ("", "two", "2-", "-3", "1,2"):
        with pytest.raises(UserError, match="--num-workers"):
            parse_worker_range(bad)
