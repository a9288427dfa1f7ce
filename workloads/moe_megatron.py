"""A tiny Megatron-Core MoE training run: two ranks on one GPU, expert parallel across both.

A real framework issues the communication here: Megatron-Core's ``alltoall`` token dispatcher
sends tokens to the rank that holds their experts (all-to-all on the expert-parallel group, with
its host-side split sizes), and the step all-reduces the dense gradients on the data-parallel
group. As in ``nccl_groups.py``, each rank claims its own host (``NCCL_HOSTID``), so NCCL talks
over its socket transport on the loopback interface and real ``ncclDevKernel_*`` kernels appear.

    pip install --no-deps megatron-core==0.19.2    # needs only torch, numpy, packaging
    python3 workloads/moe_megatron.py

The model: a 2-layer ``GPTModel`` (hidden 256, 4 heads, vocab 1024, sequence 256, micro-batch
4, bf16), every MLP a mixture of 4 experts (2 on each rank), top-2 router with the auxiliary
load-balancing loss, built from Megatron-Core's local layer spec (no Transformer Engine, no
Apex). Tensor and pipeline parallel are 1, so the data-parallel group is both ranks.

What it does, per step (NVTX ``step N``): ``forward`` (embedding, attention, router, dispatch,
experts, combine, loss); ``backward``; ``dp_grad_allreduce``: one all-reduce of the flattened bf16
gradients of the dense parameters (expert parameters, marked ``allreduce=False`` by Megatron, are
sharded and skipped); ``optimizer``: ``torch.optim.Adam``; then ``torch.cuda.synchronize()``.
Collectives per step (counted on CPU with gloo): on the expert-parallel group 12 bf16
all-to-alls (per MoE layer: tokens and their router probabilities out, expert outputs back; the
same three in backward, uneven splits), 2 int64 all-gathers of per-expert token counts; 3
fp32 all-reduces of the vocab-parallel cross-entropy on the one-rank tensor-parallel group; the
bf16 gradient all-reduce on the data-parallel group.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

STEPS = 8
PORT = 29541
TIMEOUT_S = 150  # the parent kills both ranks after this long (a rank stuck in a collective)
VOCAB, SEQ, MICRO_BATCH = 1024, 256, 4


def init_parallel(rank: int, world: int, backend: str = "nccl") -> None:
    """Process group, Megatron's parallel groups (TP 1, PP 1, EP 2) and its RNG seeds."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    dist.init_process_group(
        backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{PORT}"
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=2,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(1234)  # CPU initialisation: the dense weights must match on both ranks
    model_parallel_cuda_manual_seed(1234)


def build_model(device):
    """The MoE GPTModel in bf16, initialised on the CPU (same on every device), on ``device``."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=256,
        ffn_hidden_size=1024,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        expert_model_parallel_size=2,
        num_moe_experts=4,
        moe_ffn_hidden_size=1024,
        moe_router_topk=2,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    # As Megatron's training loop does for bf16: cast every parameter (layer norms and position
    # embeddings are created in fp32) and return the loss in fp32.
    return Float16Module(config, model).to(device)


def batch(rank: int, step: int, device):
    """Random tokens (different on each data-parallel rank), next-token labels, causal mask."""
    import torch

    gen = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen).to(device)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(MICRO_BATCH, -1)
    # Megatron's convention: True where attention is masked out, [1, 1, s, s].
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=device), diagonal=1)
    return tokens[:, :-1], position_ids, mask[None, None], tokens[:, 1:]


def allreduce_dense_grads(dense) -> None:
    """Average the dense gradients over the data-parallel group in one flat all-reduce."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    grads = [p.grad for p in dense]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for g, reduced in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(reduced.view_as(g))


def train(model, rank: int, device, steps: int = STEPS) -> list[float]:
    """``steps`` training steps, each in NVTX ranges; returns the losses."""
    import torch
    from torch.cuda import nvtx

    dense = [p for p in model.parameters() if getattr(p, "allreduce", True)]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    losses = []
    for step in range(steps):
        nvtx.range_push(f"step {step}")
        tokens, position_ids, mask, labels = batch(rank, step, device)
        nvtx.range_push("forward")
        loss = model(tokens, position_ids, mask, labels=labels).mean()  # fp32 [b, s] -> []
        nvtx.range_pop()
        nvtx.range_push("backward")
        loss.backward()
        nvtx.range_pop()
        nvtx.range_push("dp_grad_allreduce")
        allreduce_dense_grads(dense)
        nvtx.range_pop()
        nvtx.range_push("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        nvtx.range_pop()
        if device.type == "cuda":
            torch.cuda.synchronize()
        nvtx.range_pop()
        losses.append(loss.item())
    return losses


def rank_main(rank: int, world: int) -> None:
    os.environ.update(NCCL_HOSTID=f"node{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    init_parallel(rank, world, "nccl")
    model = build_model(device)
    losses = train(model, rank, device)
    print(f"rank {rank}: losses {' '.join(f'{x:.3f}' for x in losses)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world)
        return
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(args.world)])
        for r in range(args.world)
    ]
    # A rank that fails leaves the other stuck in a collective: stop it rather than wait forever.
    deadline = time.monotonic() + TIMEOUT_S
    while None in (codes := [p.poll() for p in procs]):
        if any(codes) or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            print(f"moe_megatron: exit codes {codes}, the rest killed", file=sys.stderr)
            sys.exit(1)
        time.sleep(0.2)
    sys.exit(1 if any(codes) else 0)


if __name__ == "__main__":
    main()
