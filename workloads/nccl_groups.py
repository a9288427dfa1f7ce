"""Two NCCL ranks on one GPU: an all-to-all group and an all-reduce group, a late rank, and
GEMMs run alone and beside communication.

Each rank claims its own host (``NCCL_HOSTID``), so NCCL talks over its socket transport on the
loopback interface and real ``ncclDevKernel_*`` kernels appear, as between two nodes without
InfiniBand. NCCL writes its NVTX ranges with payloads (communicator, ranks, message size).

    python3 workloads/nccl_groups.py --mode groups    # late rank + two groups
    python3 workloads/nccl_groups.py --mode overlap   # GEMMs alone, then beside an all-reduce
    python3 workloads/nccl_groups.py --steps 400      # a longer capture (12 steps by default)

What it does, per step (NVTX ``step N``):
- ``groups``: ``forward`` GEMMs; ``ep_dispatch`` all-to-all on the "ep" group (8 MiB per
  rank); ``experts`` GEMMs (rank 1 does 50% more on every third step: longer compute);
  ``ep_combine`` all-to-all; ``backward`` GEMMs; ``dp_allreduce`` all-reduce of 16 MiB of fp32
  "gradients" on the "dp" group; ``optimizer``. Rank 1 sleeps 15 ms in an NVTX range
  ``data_wait`` before the dispatch of every third step (a host-late arrival).
- ``overlap``: ``compute_alone``: rank 0 runs 8 GEMMs with no communication in flight while
  rank 1 waits on a CPU (gloo) barrier, so no other kernel shares the GPU; ``compute_beside_comm``:
  rank 0 runs the same 8 GEMMs on the default stream while an all-reduce of 64 MiB runs on
  NCCL's stream (rank 1 runs only the all-reduce).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

STEPS = 12
PORT = 29533


def rank_main(rank: int, world: int, mode: str, steps: int = STEPS) -> None:
    os.environ.update(NCCL_HOSTID=f"node{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    import torch
    import torch.distributed as dist
    from torch.cuda import nvtx

    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{PORT}"
    )
    ep = dist.new_group(list(range(world)), group_desc="ep")
    dp = dist.new_group(list(range(world)), group_desc="dp")
    cpu = dist.new_group(list(range(world)), backend="gloo", group_desc="cpu")
    dev = torch.device("cuda", 0)
    bf = torch.bfloat16
    tokens, hidden, ffn = 4096, 1024, 4096
    x = torch.randn(tokens, hidden, device=dev, dtype=bf)
    w_attn = torch.randn(hidden, hidden, device=dev, dtype=bf) / hidden**0.5
    w1 = torch.randn(hidden, ffn, device=dev, dtype=bf) / hidden**0.5
    w2 = torch.randn(ffn, hidden, device=dev, dtype=bf) / ffn**0.5
    grads = torch.randn(4 * 1024 * 1024, device=dev)  # 16 MiB fp32
    big = torch.randn(16 * 1024 * 1024, device=dev)  # 64 MiB fp32
    a = torch.randn(4096, 4096, device=dev, dtype=bf)
    b = torch.randn(4096, 4096, device=dev, dtype=bf)
    recv = torch.empty_like(x)

    def gemms(n: int, t: torch.Tensor) -> torch.Tensor:
        for _ in range(n):
            t = torch.tanh(t @ w_attn)
        return t

    for step in range(steps):
        nvtx.range_push(f"step {step}")
        if mode == "groups":
            nvtx.range_push("forward")
            h = gemms(4, x)
            nvtx.range_pop()
            if rank == 1 and step % 3 == 2:
                nvtx.range_push("data_wait")
                time.sleep(0.015)
                nvtx.range_pop()
            nvtx.range_push("ep_dispatch")
            dist.all_to_all_single(recv, h, group=ep)
            nvtx.range_pop()
            nvtx.range_push("experts")
            repeats = 3 if (rank == 1 and step % 3 == 1) else 2
            e = recv
            for _ in range(repeats):
                e = (torch.relu(e @ w1) @ w2).to(bf)
            nvtx.range_pop()
            nvtx.range_push("ep_combine")
            dist.all_to_all_single(recv, e, group=ep)
            nvtx.range_pop()
            nvtx.range_push("backward")
            gemms(8, recv)
            nvtx.range_pop()
            nvtx.range_push("dp_allreduce")
            dist.all_reduce(grads, group=dp)
            nvtx.range_pop()
            nvtx.range_push("optimizer")
            grads.mul_(0.5)
            nvtx.range_pop()
        else:
            nvtx.range_push("compute_alone")
            if rank == 0:
                c = a
                for _ in range(8):
                    c = (c @ b).clamp_(-1, 1)
                torch.cuda.synchronize()
            dist.barrier(group=cpu)
            nvtx.range_pop()
            nvtx.range_push("compute_beside_comm")
            work = dist.all_reduce(big, group=dp, async_op=True)
            if rank == 0:
                c = a
                for _ in range(8):
                    c = (c @ b).clamp_(-1, 1)
            work.wait()
            torch.cuda.synchronize()
            dist.barrier(group=cpu)
            nvtx.range_pop()
        torch.cuda.synchronize()
        nvtx.range_pop()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("groups", "overlap"), default="groups")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.mode, args.steps)
        return
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--mode",
                args.mode,
                "--rank",
                str(r),
                "--steps",
                str(args.steps),
            ]
        )
        for r in range(args.world)
    ]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
