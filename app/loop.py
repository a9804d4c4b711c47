"""The training loop for one rank: steps, epochs, validation and the state to checkpoint.

Uses torch.distributed only for the collectives that combine ranks (validation sums, RNG
gather); it runs unchanged in a single process, which is how the unit tests drive it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from app.batching import TrainBatch, TrainData, rank_seed
from app.checkpoint import TrainingState
from app.config import LoopConfig, TrainConfig, TrainingDiverged, UserError
from app.task import Task


@dataclass(frozen=True)
class EpochResult:
    train_loss: float
    """Mean training loss over the epoch's samples (all ranks)."""
    num_samples: int
    """Samples trained on, all ranks together."""
    seconds: float


@dataclass(frozen=True)
class Evaluation:
    loss: float
    """Mean validation loss over the whole split (all ranks)."""
    metrics: dict[str, float]
    """``val_<name>`` for each of the task's metrics: its mean over the whole split."""
    num_samples: int

    def as_metrics(self) -> dict[str, float]:
        return {"val_loss": self.loss, **self.metrics}


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' -> 'bf16' where the device has native bf16 (AVX512-BF16/AMX CPUs, Ampere+ GPUs).

    Autocast keeps the weights, the optimiser and the gradient all-reduce in fp32; only the
    convolutions and matrix products run in bf16 (1.6x the fp32 throughput on this project's
    2-core AVX512-BF16 benchmark machine, with the same accuracy).
    """
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"


def memory_format(model: nn.Module, channels_last: bool) -> torch.memory_format:
    """Channels-last for a model with 2-D convolutions when ``channels_last``; else the default
    (a model without 2-D convolutions has nothing to gain)."""
    if channels_last and any(isinstance(module, nn.Conv2d) for module in unwrap(model).modules()):
        return torch.channels_last
    return torch.contiguous_format


def in_layout(inputs: torch.Tensor, layout: torch.memory_format) -> torch.Tensor:
    """An image batch (4-D) in ``layout``; other inputs as they are."""
    if inputs.dim() == 4 and layout is not torch.contiguous_format:
        return inputs.contiguous(memory_format=layout)
    return inputs


def resolve_compile(mode: str, device: torch.device) -> bool:
    """'auto' -> compile on GPUs only. On this project's CPU benchmark machine the compiled
    default task trained at 0.9x the eager speed (bf16, channels-last or not), after 4-30 s of
    compiling; ``bench/gpu.py`` measures both on a GPU."""
    if mode == "auto":
        return device.type == "cuda"
    return mode == "on"


def prepare_for_speed(model: nn.Module, loop: LoopConfig, device: torch.device) -> nn.Module:
    """The model in its fast layout and, where ``loop.compile`` says so, compiled (in place:
    its parameter names, and so its checkpoints, are those of the eager model)."""
    model = model.to(memory_format=memory_format(model, loop.channels_last))
    if resolve_compile(loop.compile, device):
        model.compile()
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def parameter_checksum(model: nn.Module) -> str:
    """A digest of the exact parameter bytes: equal on every rank iff DDP kept them in sync."""
    digest = hashlib.sha256()
    for parameter in unwrap(model).parameters():
        digest.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _fp32(output):
    """Autocast outputs are bf16; losses and metrics are computed in fp32."""
    return output.float() if torch.is_floating_point(output) else output


def score_batch(task: Task, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[loss sum, each metric's sum] over one batch, float64, on the output's device."""
    count = len(targets)
    values = [task.loss(output, targets).double() * count]
    for name, metric in task.metrics.items():
        per_sample = metric(output, targets)
        if per_sample.shape[:1] != (count,):
            raise UserError(f"task {task.name}: metric {name!r} must give one value per "
                             f"sample ({count}), gave shape {tuple(per_sample.shape)}")
        values.append(per_sample.double().sum())
    return torch.stack(values)


def autocast(precision: str, device: torch.device):
    """bf16 autocast for ``precision`` "bf16"; nothing for "fp32"."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.inference_mode()
def score_batches(task: Task, model: nn.Module, batches, device: torch.device,
                  precision: str, layout: torch.memory_format = torch.contiguous_format,
                  ) -> tuple[torch.Tensor, int]:
    """[loss sum, each metric's sum] (float64, on ``device``) and the sample count over
    ``batches`` of (inputs, targets); the model must be in eval mode."""
    sums = torch.zeros(1 + len(task.metrics), dtype=torch.float64, device=device)
    count = 0
    for inputs, targets in batches:
        inputs = in_layout(inputs.to(device, non_blocking=True), layout)
        targets = targets.to(device, non_blocking=True)
        with autocast(precision, device):
            output = _fp32(model(inputs))
        sums += score_batch(task, output, targets)
        count += len(targets)
    return sums, count


def _all_reduce_sum(values: list[float], device: torch.device,
                    op=dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return tensor.tolist()


class TimedSchedule:
    """The steps at which every rank does something together (a collective), about every
    ``period_s`` seconds.

    Each rank's clock would pick a different step, and a collective needs all of them at the
    same one. So at every due step the ranks all-reduce the seconds since the previous due step
    (the maximum), and each derives the next due step from that one shared number: the same on
    every rank. One small all-reduce per due step, nothing per step.
    """

    def __init__(self, period_s: float, device: torch.device, start_step: int,
                 first_after: int = 1):
        self.period_s = period_s
        self.device = device
        self.next_step = start_step + first_after
        self._last_step = start_step
        self._last_time = time.perf_counter()

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def reschedule(self, step: int, flags: tuple[float, ...] = ()) -> list[float]:
        """After the due ``step`` (a collective: every rank calls it at that step). ``flags``
        ride along: returns their maximum over the ranks (what one rank saw, all now know)."""
        now = time.perf_counter()
        elapsed, *shared = _all_reduce_sum([now - self._last_time, *flags], self.device,
                                           op=dist.ReduceOp.MAX)
        steps_per_second = (step - self._last_step) / max(elapsed, 1e-6)
        self.next_step = step + max(1, round(self.period_s * steps_per_second))
        self._last_step, self._last_time = step, now
        return shared


class Trainer:
    """Trains ``model`` (already wrapped by DDP when world_size > 1) on ``data``, with the
    task's loss, optimiser and metrics; everything else is the task's business."""

    def __init__(
        self,
        config: TrainConfig,
        task: Task,
        model: nn.Module,
        data: TrainData,
        device: torch.device,
        rank: int,
        world_size: int,
        state: TrainingState | None = None,
    ):
        self.config = config
        self.task = task
        self.model = model
        self.data = data
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.precision = resolve_precision(config.loop.precision, device)
        self.layout = memory_format(model, config.loop.channels_last)
        self._first_bad_step = torch.zeros((), dtype=torch.int64, device=device)
        self._loss_total = torch.zeros((), dtype=torch.float64, device=device)
        self._local_samples = 0
        self.optimizer = task.build_optimizer(model.parameters(), config.optim.lr)
        self.scheduler = (
            task.build_scheduler(self.optimizer, config.loop.epochs) if task.build_scheduler
            else torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1,
                                                 gamma=config.optim.lr_decay)
        )
        self.state = state or TrainingState(
            global_batch_size=config.loop.global_batch_size, config=config.to_dict()
        )
        if state is not None:
            unwrap(model).load_state_dict(state.model)
            self.optimizer.load_state_dict(state.optimizer)
            self.scheduler.load_state_dict(state.scheduler)

    def _seed_rank(self, epoch: int) -> None:
        # Dropout masks and augmentations come from torch's RNG, seeded per (seed, epoch, rank).
        # Mid-epoch, the exact RNG state of each rank is restored instead when the world size
        # is unchanged.
        if self.state.epoch_step > 0 and len(self.state.rng_states) == self.world_size:
            torch.set_rng_state(self.state.rng_states[self.rank])
        else:
            torch.manual_seed(rank_seed(self.config.loop.seed, epoch, self.rank))

    @property
    def epochs_done(self) -> int:
        return self.state.epoch

    def _autocast(self):
        return autocast(self.precision, self.device)

    def _micro_batches(self, batch: TrainBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        limit = self.config.loop.max_batch_per_worker
        if limit == 0 or len(batch.targets) <= limit:
            return [(batch.inputs, batch.targets)]
        return list(zip(torch.split(batch.inputs, limit), torch.split(batch.targets, limit)))

    def _run_batch(self, batch: TrainBatch) -> torch.Tensor:
        """One optimiser step on this rank's share of a global batch; returns its loss sum."""
        self.optimizer.zero_grad(set_to_none=True)
        micro_batches = self._micro_batches(batch)
        loss_sum = torch.zeros((), device=self.device)
        for position, (inputs, targets) in enumerate(micro_batches):
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            if self.task.augment is not None:
                inputs = self.task.augment(inputs)
            inputs = in_layout(inputs, self.layout)
            is_last = position == len(micro_batches) - 1
            # Gradients of all but the last micro-batch accumulate locally; DDP all-reduces once.
            sync = contextlib.nullcontext() if is_last or not hasattr(self.model, "no_sync") \
                else self.model.no_sync()
            with sync:
                with self._autocast():
                    output = self.model(inputs)
                # The task's batch mean, made a sum over this rank's samples and scaled so DDP's
                # mean over ranks is the mean over the whole global batch, however it was split:
                # world-size-invariant gradients.
                micro_loss = self.task.loss(_fp32(output), targets) * len(targets)
                (micro_loss * (self.world_size / batch.global_size)).backward()
            loss_sum += micro_loss.detach()
        self._note_finite_gradient()
        self.optimizer.step()
        return loss_sum

    def _note_finite_gradient(self) -> None:
        """Note, on the device, the first step whose gradient was NaN or infinite, and zero such
        a gradient so the step leaves the weights finite.

        No host sync per step: ``check_diverged`` reads the note at the periodic check, before
        every checkpoint and at the epoch's end, so a diverged model is never checkpointed. The
        gradients are all-reduced, the same on every rank, so every rank stops at the same check
        and names the same step (a NaN loss on any rank makes the summed gradient NaN).
        """
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not gradients:
            return
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gradients)))
        bad = ~torch.isfinite(norm)
        for gradient in gradients:
            gradient.masked_fill_(bad, 0.0)
        first = bad & (self._first_bad_step == 0)
        self._first_bad_step = torch.where(first, self.state.step + 1, self._first_bad_step)

    def check_diverged(self) -> None:
        """Raise TrainingDiverged if a step since the start had a NaN or infinite gradient."""
        step = int(self._first_bad_step)
        if step:
            self._diverged("the loss or its gradient became NaN or infinite", step)

    def _diverged(self, what: str, step: int) -> None:
        raise TrainingDiverged(
            f"training diverged at step {step} (epoch {self.state.epoch + 1}): "
            f"{what}; lower the learning rate (it is {self.config.optim.lr:g}) and rerun "
            "under a new --name (the checkpoints of this run are kept)"
        )

    def _check_finite_weights(self) -> None:
        # The same on every rank (DDP keeps the weights equal), so every rank raises together.
        for parameter in unwrap(self.model).parameters():
            if not torch.isfinite(parameter).all():
                self._diverged("the weights became NaN or infinite", self.state.step)

    def run_epoch(self, after_step: Callable[[], None] | None = None) -> EpochResult:
        """Train the rest of the current epoch; ``after_step`` runs after every step (on every
        rank, so it may checkpoint) and its time is not counted as training time."""
        epoch = self.state.epoch
        self._seed_rank(epoch)
        self.model.train()
        # A resumed epoch carries on from the checkpoint's sums; rank 0 holds the global part.
        resumed_loss = self.state.epoch_loss_sum if self.rank == 0 else 0.0
        self._loss_total = torch.tensor(resumed_loss, dtype=torch.float64, device=self.device)
        self._local_samples = 0
        self._seconds = self.state.epoch_seconds
        started = time.perf_counter()
        for batch in self.data.train_batches(epoch, self.state.epoch_step):
            # Accumulated on the device: .item() per step would force a GPU sync.
            self._loss_total += self._run_batch(batch)
            self._local_samples += len(batch.targets)
            self.state.step += 1
            self.state.epoch_step += 1
            self.state.epoch_samples += batch.global_size
            if after_step is not None:
                self._seconds += time.perf_counter() - started
                after_step()
                started = time.perf_counter()
        self._seconds += time.perf_counter() - started
        self.check_diverged()
        (loss_sum,) = _all_reduce_sum([self._loss_total.item()], self.device)
        if not math.isfinite(loss_sum):  # summed over ranks: every rank sees the same
            self._diverged("the epoch's training loss is NaN or infinite", self.state.step)
        result = EpochResult(
            train_loss=loss_sum / max(self.state.epoch_samples, 1),
            num_samples=self.state.epoch_samples,
            seconds=self._seconds,
        )
        self.scheduler.step()
        self.state.epoch = epoch + 1
        self.state.epoch_step = 0
        self.state.epoch_loss_sum = 0.0
        self.state.epoch_samples = 0
        self.state.epoch_seconds = 0.0
        return result

    def running_loss(self) -> tuple[float, int]:
        """This rank's loss sum in the current epoch and the samples it covers, for progress
        points between them (a host sync: call it a few times a second at most)."""
        return float(self._loss_total), self._local_samples

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def evaluate(self) -> Evaluation:
        """The loss and the task's metrics over the validation split, each rank scoring its
        part; exact means over the whole split."""
        model = unwrap(self.model)
        model.eval()
        names = list(self.task.metrics)
        # Sums in float64 on the device, one host sync at the end.
        sums, count = score_batches(
            self.task, model, self.data.val_batches(self.config.loop.eval_batch_size),
            self.device, self.precision, self.layout,
        )
        totals = _all_reduce_sum([*sums.tolist(), float(count)], self.device)
        total = max(totals[-1], 1.0)
        return Evaluation(
            loss=totals[0] / total,
            metrics={f"val_{name}": value / total for name, value in zip(names, totals[1:-1])},
            num_samples=int(totals[-1]),
        )

    def snapshot(self) -> TrainingState:
        """The state to checkpoint, at an epoch end or mid-epoch (from ``after_step``).

        A collective: every rank's RNG state is gathered, and mid-epoch the loss so far is summed.
        Raises TrainingDiverged rather than return weights that are not finite.
        """
        self.check_diverged()
        self._check_finite_weights()
        if self.state.epoch_step > 0:
            (self.state.epoch_loss_sum,) = _all_reduce_sum([self._loss_total.item()], self.device)
            self.state.epoch_seconds = self._seconds
        rng_states = [torch.get_rng_state()]
        if dist.is_initialized() and self.world_size > 1:
            rng_states = [None] * self.world_size
            dist.all_gather_object(rng_states, torch.get_rng_state())
        self.state.model = {k: v.detach().cpu() for k, v in unwrap(self.model).state_dict().items()}
        self.state.optimizer = self.optimizer.state_dict()
        self.state.scheduler = self.scheduler.state_dict()
        self.state.rng_states = rng_states
        return self.state
