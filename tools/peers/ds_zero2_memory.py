#!/usr/bin/env python3
"""Workload b: DeepSpeed ZeRO-2 memory per rank for a >= 1B-param bf16 stack, world size 1 over NCCL.

The model has the shape of ShardSwap's byte decoder (peerlib.DecoderLike: transformers'
LlamaForCausalLM, vocabulary 256, tied head), so `shardswap plan/train` with the same model.* keys
holds exactly the same params. DeepSpeed gets the settings of configs/gpu-300m.json:
bf16, ZeRO stage 2, reduce_bucket_size 5e7, overlap_comm, contiguous gradients, AdamW, clipping 1.0.
Launch with torchrun (one process per GPU; the brief's case is --nproc_per_node 1):

    torchrun --nproc_per_node 1 tools/peers/ds_zero2_memory.py [--hidden-size 2048
        --intermediate-size 8192 --num-hidden-layers 18 --num-attention-heads 16
        --num-key-value-heads 8] [--seq-len 128] [--micro-batch 8] [--steps 10] [--jsonl FILE]

Reports torch.cuda memory of rank 0: allocated after the model is on the GPU, after
deepspeed.initialize, peak during initialize, peak during the steps and steady allocated after the
last step, with the ZeRO formula 2P + 14P/N (bit16 params, plus sharded bit16 grads and fp32 master,
m, v). FusedAdam is JIT-built; if it cannot be, DeepSpeed's torch_adam is used and the error recorded.
"""
import argparse
import sys
import time

import peerlib

SCRIPT = "ds_zero2_memory.py"


def fused_adam_error():
    """None when DeepSpeed's FusedAdam op loads (JIT-built if needed), else the exact error."""
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder
        FusedAdamBuilder().load()
        return None
    except Exception as exc:
        return peerlib.exception_text(exc)


def ds_config(args, torch_adam):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e8,
                              "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01, "torch_adam": torch_adam}},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peerlib.DecoderLike.add_args(ap, peerlib.DecoderLike.MEMORY_SHAPE)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--min-params", type=float, default=1e9,
                    help="refuse a model smaller than this (the brief asks for >= 1B)")
    ap.add_argument("--jsonl", help="also append the JSON lines to this file")
    args = ap.parse_args()
    for k in peerlib.DecoderLike.KEYS + ("seq_len", "micro_batch", "steps"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    shape = [getattr(args, k) for k in peerlib.DecoderLike.KEYS]
    params = peerlib.DecoderLike.param_count(*shape)
    if params < args.min_params:
        ap.error(f"the model has {params} params, under --min-params {args.min_params:.0f}")

    base = {"workload": "zero2_memory", "system": "deepspeed", "script": SCRIPT, "params": params,
            "model": dict(zip(peerlib.DecoderLike.KEYS, shape)), "seq_len": args.seq_len,
            "micro_batch": args.micro_batch}
    torch = peerlib.need_cuda(SCRIPT)
    try:
        import deepspeed
    except Exception as exc:
        peerlib.fail(SCRIPT, "import deepspeed: " + peerlib.exception_text(exc), base, args.jsonl)
    dist, rank, world, local = peerlib.init_nccl(torch, SCRIPT)
    base.update(world_size=world, deepspeed=deepspeed.__version__, torch=torch.__version__)

    error = fused_adam_error()
    model = peerlib.DecoderLike.build(torch, *shape, args.seq_len, torch.bfloat16,
                                      f"cuda:{local}")
    counted = sum(p.numel() for p in model.parameters())
    if counted != params:
        peerlib.fail(SCRIPT, f"model holds {counted} params, formula says {params}", base,
                     args.jsonl)
    torch.cuda.synchronize()
    model_bytes = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        started = time.perf_counter()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(args, error is not None))
        init_s = time.perf_counter() - started
    except Exception as exc:
        peerlib.fail(SCRIPT, "deepspeed.initialize: " + peerlib.exception_text(exc), base,
                     args.jsonl)
    torch.cuda.synchronize()
    after_init = torch.cuda.memory_allocated()
    peak_init = torch.cuda.max_memory_allocated()
    optimizer_name = type(engine.optimizer.optimizer).__name__
    torch.cuda.reset_peak_memory_stats()

    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    allocated, losses, step_ms = [], [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (args.micro_batch, args.seq_len), device="cuda",
                               generator=gen)
        started = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss  # mean next-token cross-entropy
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - started) * 1e3)
        losses.append(loss.item())
        allocated.append(torch.cuda.memory_allocated())
    peak_steps = torch.cuda.max_memory_allocated()
    if not all(l == l and abs(l) < 1e4 for l in losses):
        peerlib.fail(SCRIPT, f"losses not finite: {losses}", base, args.jsonl)
    formula = 2 * params + 14 * params / world
    if rank == 0:
        peerlib.emit(dict(base, status="ok", optimizer=optimizer_name, fused_adam_error=error,
                          model_bytes=model_bytes, after_init_bytes=after_init,
                          peak_init_bytes=peak_init, peak_steps_bytes=peak_steps,
                          peak_bytes=max(peak_init, peak_steps), steady_bytes=allocated[-1],
                          allocated_per_step=allocated, zero_formula_bytes=formula,
                          init_s=init_s, step_ms_median=sorted(step_ms)[len(step_ms) // 2],
                          loss_first=losses[0], loss_last=losses[-1],
                          reserved_bytes=torch.cuda.max_memory_reserved()), args.jsonl)
    engine.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
