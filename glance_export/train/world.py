"""Data-parallel training under `torchrun`: which process this is, on which device, and the few collectives
the trainer needs. Without torchrun's environment it is a world of one and nothing is initialised.

Gradients are averaged by one all-reduce of a flat buffer after each backward (the head is replicated on every
process), so N processes at batch b step exactly as one at batch N*b. NCCL on CUDA, gloo on the CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from glance_runtime.errors import GlanceError


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    device: torch.device

    @property
    def main(self) -> bool:
        """The one process that writes checkpoints, logs and the head."""
        return self.rank == 0

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value`, in rank order (a picklable object)."""
        if self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def any(self, flag: bool) -> bool:
        """True on every process if it is true on one (a time budget reached by one stops all)."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """The sum of `values` over every process (for logs of the global batch)."""
        if self.size == 1:
            return values
        values = values.detach().clone()
        dist.all_reduce(values)
        return values

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        if self.size == 1:
            return
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def parse_device(name: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N`, refused in one line when this machine has no such device."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise GlanceError(f"--device {name!r} is not a device; pass cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise GlanceError(f"--device {name!r}: training runs on cpu or cuda[:N]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GlanceError(f"--device {name}: this torch sees no CUDA device; pass --device cpu or install a "
                              "CUDA build of torch")
        if (device.index or 0) >= torch.cuda.device_count():
            raise GlanceError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def join(device: str) -> World:
    """This process's place: under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) join the process group, each
    process on its own GPU (cuda:LOCAL_RANK) or the CPU; else a world of one on `device`."""
    base = parse_device(device)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(0, 1, base)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if base.type == "cuda":
        base = torch.device("cuda", local)
        torch.cuda.set_device(base)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if base.type == "cuda" else "gloo")
    return World(rank, size, base)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
