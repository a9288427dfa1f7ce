"""A training loop starved by its data loader, for captures that record the host side.

    nsys profile -t cuda,nvtx,osrt --sample=cpu --python-sampling=true ... \
        python3 workloads/slow_loader.py

Each step (NVTX ``step N`` only: no range marks the data loading, so only OS runtime calls, CPU
samples and thread scheduling can say what the host did) fetches one batch from a
``torch.utils.data.DataLoader`` with no workers whose dataset reads a file (``read``), decodes
and augments it with numpy (CPU samples) and waits 4 ms per sample on a slow "storage" thread
through a queue (``pthread_cond_wait``/``futex``), then runs an MLP forward, backward and Adam.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import time

import numpy as np
import torch
from torch.cuda import nvtx

STEPS = 14
BATCH = 8
FEATURES = 2048


class Storage(threading.Thread):
    """Serves file paths one at a time, slowly, like a remote store."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__(daemon=True)
        self.paths, self.out = paths, queue.Queue(maxsize=1)

    def run(self) -> None:
        i = 0
        while True:
            time.sleep(0.004)
            self.out.put(self.paths[i % len(self.paths)])
            i += 1


class SlowDataset(torch.utils.data.Dataset):
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> torch.Tensor:
        path = self.storage.out.get()
        with open(path, "rb") as f:
            raw = f.read()
        a = np.frombuffer(raw, dtype=np.uint8).astype(np.float32)
        for _ in range(4):
            a = np.sqrt(a * 1.0001 + 1.0)
        a = np.sort(a[: FEATURES * 64]).reshape(64, FEATURES)
        return torch.from_numpy(a)


def main() -> None:
    tmp = tempfile.mkdtemp()
    paths = []
    for k in range(4):
        path = os.path.join(tmp, f"shard{k}.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(FEATURES * 64 * 4))
        paths.append(path)
    storage = Storage(paths)
    storage.start()
    loader = torch.utils.data.DataLoader(SlowDataset(storage), batch_size=BATCH, num_workers=0)
    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 4 * FEATURES),
        torch.nn.GELU(),
        torch.nn.Linear(4 * FEATURES, FEATURES),
    ).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = iter(loader)
    for step in range(STEPS):
        nvtx.range_push(f"step {step}")
        x = next(batches).to(dev, torch.bfloat16, non_blocking=False).reshape(-1, FEATURES)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        nvtx.range_pop()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
