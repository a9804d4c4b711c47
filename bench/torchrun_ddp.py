"""A plain torchrun DDP script, as people write one: the baseline bench/gpu.py measures the app
against, on the same models and data.

torchvision data sets with per-sample transforms through a DataLoader (4 loader processes per
rank, pinned memory) and a DistributedSampler, DDP over NCCL (gloo on CPU), fp32, eager. MNIST:
the book's ConvNet with Adadelta lr 0.5; CIFAR-10: the app's 32x32 ResNet-18 with SGD (Nesterov
momentum 0.9, lr 0.1, weight decay 5e-4) and random crop and flip. After every epoch each rank
scores its share of the validation split; rank 0 writes, per epoch, the training samples/s, the
training seconds so far and the validation accuracy to ``--output`` (JSON).

    torchrun --nproc-per-node 8 bench/torchrun_ddp.py --task mnist --data-dir DIR --output r.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from app.model import ConvNet, cifar_resnet18


def _data(task: str, data_dir: str):
    if task == "mnist":
        normalise = transforms.Compose([transforms.ToTensor(),
                                        transforms.Normalize((0.1307,), (0.3081,))])
        return (datasets.MNIST(data_dir, train=True, transform=normalise),
                datasets.MNIST(data_dir, train=False, transform=normalise))
    normalise = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    augment = transforms.Compose([transforms.RandomCrop(32, padding=4),
                                  transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                  normalise])
    plain = transforms.Compose([transforms.ToTensor(), normalise])
    return (_CIFAR10(data_dir, train=True, transform=augment),
            _CIFAR10(data_dir, train=False, transform=plain))


class _CIFAR10(datasets.CIFAR10):
    """torchvision's CIFAR-10 without its checksum test, so bench/gpu.py's random images (in the
    same format) load too; the real files pass it anyway."""

    def _check_integrity(self) -> bool:
        return True

    def _load_meta(self) -> None:
        self.classes = [str(number) for number in range(10)]
        self.class_to_idx = {name: number for number, name in enumerate(self.classes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--task", choices=("mnist", "cifar10"), required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--loader-workers", type=int, default=4)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    train, val = _data(args.task, args.data_dir)
    sampler = DistributedSampler(train)
    loader = DataLoader(train, batch_size=args.global_batch_size // world, sampler=sampler,
                        num_workers=args.loader_workers, pin_memory=cuda,
                        persistent_workers=args.loader_workers > 0)
    val_loader = DataLoader(val, batch_size=1000, sampler=DistributedSampler(val, shuffle=False),
                            num_workers=args.loader_workers, pin_memory=cuda)
    if args.task == "mnist":
        model = DDP(ConvNet().to(device))
        optimizer = torch.optim.Adadelta(model.parameters(), lr=0.5)
    else:
        model = DDP(cifar_resnet18().to(device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                    weight_decay=5e-4)
    epochs, trained_s = [], 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        if cuda:
            torch.cuda.synchronize()
        started, samples = time.perf_counter(), 0
        for inputs, targets in loader:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device,
                                                                              non_blocking=True)
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            samples += len(targets) * world
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        trained_s += seconds
        model.eval()
        correct = torch.zeros(2, device=device)
        with torch.no_grad():
            for inputs, targets in val_loader:
                inputs, targets = inputs.to(device), targets.to(device)
                correct += torch.stack([(model(inputs).argmax(1) == targets).sum(),
                                        torch.tensor(len(targets), device=device)]).float()
        dist.all_reduce(correct)
        epochs.append({"epoch": epoch + 1, "samples_per_second": samples / seconds,
                       "training_seconds": trained_s,
                       "val_accuracy": (correct[0] / correct[1]).item()})
        if rank == 0:
            print(json.dumps(epochs[-1]), flush=True)
    if rank == 0:
        with open(args.output, "w") as out:
            json.dump(epochs, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
