"""This worker's place in its tensor-parallel group, and the two collectives the sharded layers need.

One torch.distributed process group per worker process (gloo on CPU, NCCL on CUDA), made once at
start-up before the model is built; the layers read `tp()` while they are constructed to size their
shard (common/tp_layout.py), and call `all_reduce` / `all_gather` in forward. A group of one (the
default) never touches torch.distributed, so TP=1 runs exactly as before.

Every rank receives the same step and samples the same tokens from the same gathered logits with the
same seeded generators, so every rank's sequence state stays identical; only rank 0 replies.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch

log = logging.getLogger("pagedserve.worker")


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_group = TPGroup()


def tp() -> TPGroup:
    return _group


COLLECTIVE_TIMEOUT_S = 60.0    # a collective whose peer neither answers nor dies fails after this
_pg = None                     # the collectives' group (torch.distributed.ProcessGroup)


def init_tensor_parallel(rank: int, size: int, init_addr: str, device: torch.device, join_timeout_s: float) -> TPGroup:
    """Join the group through the TCP store at `init_addr` (HOST:PORT; rank 0 hosts it). Blocks until all
    `size` ranks have joined, at most `join_timeout_s` (remote ranks may be started by hand). The
    collectives then run in a group with COLLECTIVE_TIMEOUT_S: a rank whose peer hangs raises instead
    of waiting forever, and one whose peer dies fails at once (the peer's sockets close)."""
    global _group, _pg
    if size > 1:
        import torch.distributed as dist
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=join_timeout_s))
        _pg = dist.new_group(list(range(size)), timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        log.info("rank %d of %d joined the %s group at %s", rank, size, backend, init_addr)
    _group = TPGroup(rank, size)
    return _group


def shutdown_tensor_parallel() -> None:
    global _group, _pg
    if _group.size > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    _group, _pg = TPGroup(), None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's x (a row-parallel layer's partial products), in place."""
    if _group.size > 1:
        import torch.distributed as dist
        dist.all_reduce(x, group=_pg)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x concatenated along the last dimension, in rank order (the vocab-parallel logits)."""
    if _group.size == 1:
        return x
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x.contiguous(), group=_pg)
    return torch.cat(parts, dim=-1)
