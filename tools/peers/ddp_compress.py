#!/usr/bin/env python3
"""Workload c (seed 000): PyTorch DDP peak memory with and without fp16/bf16 compress hooks.

One configuration per process (the seed's point: peaks must not mix), launched by torchrun with one
process per GPU. Models: the seed's Linear(512, 4096) in fp32, or a >= 1B-param fp32 stack of
Linear(width, hidden) / Linear(hidden, width) pairs (--model stack). Five SGD steps as in the seed;
reports torch.cuda.memory_allocated after them and max_memory_allocated over them, with the size of
the fp32 gradients, so the hook's extra bytes can be read against it.

    torchrun --nproc_per_node N tools/peers/ddp_compress.py --model linear|stack --hook none|fp16|bf16
        [--width 4096 --hidden 16384 --pairs 8] [--jsonl FILE]
"""
import argparse
import sys

import peerlib

SCRIPT = "ddp_compress.py"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("linear", "stack"), required=True)
    ap.add_argument("--hook", choices=("none", "fp16", "bf16"), required=True)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=16384)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--jsonl", help="also append the JSON lines to this file")
    args = ap.parse_args()
    if min(args.width, args.hidden, args.pairs, args.batch, args.steps) < 1:
        ap.error("--width, --hidden, --pairs, --batch and --steps must be >= 1")
    if args.model == "stack":
        params = args.pairs * 2 * (args.width * args.hidden) + args.pairs * (args.hidden + args.width)
        if params < 1e9:
            ap.error(f"--model stack has {params} params; the brief asks for >= 1B")
        in_features = args.width
    else:
        params, in_features = 512 * 4096 + 4096, 512

    base = {"workload": "compress_peak", "system": "pytorch_ddp", "script": SCRIPT,
            "model": args.model, "hook": args.hook, "params": params, "dtype": "fp32"}
    torch = peerlib.need_cuda(SCRIPT)
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    dist, rank, world, local = peerlib.init_nccl(torch, SCRIPT)
    base.update(world_size=world, torch=torch.__version__)
    device = torch.device("cuda", local)
    with device:
        if args.model == "linear":
            model = torch.nn.Linear(512, 4096)
        else:
            layers = []
            for _ in range(args.pairs):
                layers += [torch.nn.Linear(args.width, args.hidden),
                           torch.nn.Linear(args.hidden, args.width)]
            model = torch.nn.Sequential(*layers)
    counted = sum(p.numel() for p in model.parameters())
    if counted != params:
        peerlib.fail(SCRIPT, f"model holds {counted} params, expected {params}", base, args.jsonl)
    ddp = DDP(model, device_ids=[local])
    if args.hook != "none":
        hook = {"fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[args.hook]
        ddp.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated()
    for _ in range(args.steps):
        y = ddp(torch.randn(args.batch, in_features, device=device)).mean()
        y.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    if not torch.isfinite(y).item():
        peerlib.fail(SCRIPT, "output not finite", base, args.jsonl)
    record = dict(base, status="ok", rank=rank, grad_bytes=4 * params, start_bytes=start_bytes,
                  allocated_bytes=torch.cuda.memory_allocated(),
                  peak_bytes=torch.cuda.max_memory_allocated())
    gathered = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        record["peak_bytes_max_over_ranks"] = max(r["peak_bytes"] for r in gathered)
        peerlib.emit(record, args.jsonl)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
