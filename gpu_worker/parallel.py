"""This worker's place in its tensor-parallel group, and the two collectives the sharded layers need.

One torch.distributed process group per worker process (gloo on CPU, NCCL on CUDA), made once at
start-up before the model is built; the layers read `tp()` while they are constructed to size their
shard (common/tp_layout.py), and call `all_reduce` / `all_gather` in forward. A group of one (the
default) never touches torch.distributed, so TP=1 runs exactly as before.

Every rank receives the same step and samples the same tokens from the same gathered logits with the
same seeded generators, so every rank's sequence state stays identical; only rank 0 replies.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
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
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = interface_towards(init_addr)
            if ifname:      # gloo would advertise the hostname's address, often 127.0.0.1
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        if device.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=join_timeout_s))
        _pg = dist.new_group(list(range(size)), timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        log.info("rank %d of %d joined the %s group at %s", rank, size, backend, init_addr)
    _group = TPGroup(rank, size)
    return _group


def interface_towards(addr: str) -> str | None:
    """The network interface this host reaches HOST:PORT through (None: loopback or not found), so
    that every rank tells its peers an address they can reach."""
    host, port = addr.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))             # UDP: picks the route, sends nothing
        local = s.getsockname()[0]
        if local.startswith("127."):
            return None
        for _, name in socket.if_nameindex():
            try:
                req = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:                      # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(req[20:24]) == local:
                return name
    return None


SIOCGIFADDR = 0x8915      # Linux: an interface's IPv4 address


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
