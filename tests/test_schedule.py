"""The time-based collective schedule (preemption checks): every rank picks the same steps,
however different their clocks and speeds."""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from app.loop import TimedSchedule


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    schedule = TimedSchedule(0.05, torch.device("cpu"), start_step=100)
    due = []
    for step in range(101, 161):
        time.sleep(0.002 if rank == 0 else 0.006)  # rank 1 is three times slower
        if schedule.due(step):
            schedule.reschedule(step)  # a collective: hangs unless both ranks are here
            due.append(step)
    results.put((rank, due))
    dist.destroy_process_group()


def test_every_rank_picks_the_same_steps():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_rank, args=(port, results), nprocs=2, start_method="spawn")
    found = dict(results.get() for _ in range(2))
    assert found[0] == found[1], found
    assert found[0][0] == 101, "the first check is at the first step after a (re)start"
    # About every 0.05 s at the slower rank's ~6 ms a step: every ~8 steps, not every step.
    gaps = [later - earlier for earlier, later in zip(found[0][1:], found[0][2:])]
    assert 3 <= sum(gaps) / len(gaps) <= 16, found[0]


def test_a_single_process_needs_no_process_group():
    schedule = TimedSchedule(10.0, torch.device("cpu"), start_step=0)
    assert schedule.due(1) and not schedule.due(0)
    schedule.reschedule(1)
    assert schedule.next_step > 100  # 10 s at the pace of a step that took microseconds
