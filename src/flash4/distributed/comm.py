"""The ring's point-to-point exchange: each rank sends tensors to rank + 1 and receives the same
shapes from rank - 1, asynchronously (started before a block's compute, waited after it).

    TorchRing(group)      over torch.distributed (batch_isend_irecv; NCCL, or gloo with CUDA
                          tensors staged through host memory)
    local_rings(W)        W in-process rings joined by queues, one per thread: emulates W ranks in
                          one process (tests; a single GPU running a W-rank ring's exact work)
"""

from __future__ import annotations

import queue

import torch


class Pending:
    """An exchange in flight; wait() -> the received tensors (in the order sent)."""

    def __init__(self, works, received, device=None):
        self._works, self._received, self._device = works, received, device

    def wait(self) -> list:
        for w in self._works:
            w.wait()
        if self._device is not None:  # staged through host memory
            return [t.to(self._device, non_blocking=False) for t in self._received]
        return self._received


class TorchRing:
    """The ring of the ranks of a torch.distributed process group (None: the default group), in
    group-rank order. exchange(tensors) posts one send to the next rank and one receive from the
    previous per tensor, as one batch_isend_irecv (NCCL groups them into one launch)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world_size)
        self._host_staged = dist.get_backend(self.group) == "gloo"

    def exchange(self, tensors) -> Pending:
        dist = self._dist
        device = tensors[0].device
        stage = self._host_staged and device.type != "cpu"
        send = [t.contiguous().cpu() if stage else t.contiguous() for t in tensors]
        recv = [torch.empty_like(t) for t in send]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group) for t in recv]
        return Pending(dist.batch_isend_irecv(ops), recv, device if stage else None)


class _LocalRing:
    """One rank of local_rings(): exchange() puts copies in the next rank's box."""

    def __init__(self, rank, world_size, boxes):
        self.rank, self.world_size, self._boxes = rank, world_size, boxes

    def exchange(self, tensors) -> Pending:
        self._boxes[(self.rank + 1) % self.world_size].put([t.detach().clone() for t in tensors])
        return _QueuePending(self._boxes[self.rank])


class _QueuePending:
    """A local exchange in flight: wait() takes the previous rank's tensors from this rank's box."""

    def __init__(self, box):
        self._box = box

    def wait(self) -> list:
        return self._box.get(timeout=600)


def local_rings(world_size: int) -> list:
    """world_size rings emulating the ranks of one ring inside one process (each used by its own
    thread: a rank's exchange returns once posted; its wait blocks until the previous rank's
    tensors arrive, so the ranks must run concurrently). On a GPU the threads compute gradients with
    flash4.distributed.backward_here, not out.backward(): torch's autograd engine runs CUDA backward
    nodes on one worker thread per device, where the emulated ranks would wait on each other forever."""
    boxes = [queue.Queue() for _ in range(world_size)]
    return [_LocalRing(r, world_size, boxes) for r in range(world_size)]
