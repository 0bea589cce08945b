#!/usr/bin/env python3
"""Workload e: decoder training tokens/s of the peers at Qwen2.5 shapes, full fine-tune and LISA.

The peers of ShardSwap's training benchmark, on the same shapes, sequence length and batch:
  --system torch      transformers' Qwen2ForCausalLM, fp32 params under bf16 autocast, SDPA
                      attention, gradient norm clipped to 1.0, torch.optim.AdamW(fused=True) (what
                      an HF Trainer run with bf16 does: its max_grad_norm is 1.0)
  --system deepspeed  the same model in bf16 under DeepSpeed ZeRO stage 2 (fp32 master and Adam
                      state, FusedAdam, gradient_clipping 1.0), world size 1 over NCCL; launch
                      with torchrun
Both clip at 1.0 as ShardSwap's configs/qwen2.5-*.json do.
LISA (--mode lisa): only the embedding, the final norm with the head, and two body layers (a third
and two thirds of the way up) are trainable; the rest is frozen (requires_grad False), so the
optimizer holds state for those alone, as LISA's authors run it.

    python3 tools/peers/train_throughput.py --system torch --shape 0.5b --mode full --micro-batch 8
    torchrun --nproc_per_node 1 tools/peers/train_throughput.py --system deepspeed --shape 1.5b ...

Random weights (from_config), tokens from an llm.c token file (--tokens) or uniform random ids. A
step is forward, backward, optimizer step, zero_grad, timed with a device synchronize around it;
tokens/s is micro-batch x seq-len over the median step after --warmup steps. When the given
micro-batch runs out of memory the row says so and the next try halves it, down to 1 (each try
its own row: the table says at what batch a peer fits). The loss of the first and last timed step
is recorded: finite, or the row is an error.
"""
import argparse
import gc
import math
import statistics
import sys
import time

import peerlib

SCRIPT = "train_throughput.py"

# config.json fields of the Qwen2.5 checkpoints (Qwen/Qwen2.5-*), the same as configs/qwen2.5-*.json.
QWEN25 = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
               tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
}
PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, nominal


def build_model(torch, shape, seq_len, dtype):
    import transformers
    config = transformers.Qwen2Config(**QWEN25[shape], max_position_embeddings=max(32768, seq_len),
                                      rope_theta=1e6, rms_norm_eps=1e-6, use_sliding_window=False,
                                      attn_implementation="sdpa")
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(config)
    return model.to(dtype)


def lisa_layers(layers):
    return sorted({layers // 3, (2 * layers) // 3})


def freeze_for(model, mode):
    """Full: everything trains. LISA: embedding, final norm, head and lisa_layers()."""
    if mode == "full":
        return
    keep = {f"model.layers.{i}." for i in lisa_layers(model.config.num_hidden_layers)}
    for name, p in model.named_parameters():
        p.requires_grad = (name.startswith("model.embed_tokens.") or name.startswith("model.norm.")
                           or name.startswith("lm_head.") or any(name.startswith(k) for k in keep))


def flops_per_token(config, seq_len):
    """6 N + 12 L H seq (N every param, H the hidden size): the benchmark's convention."""
    c = config
    hd = c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = (c.hidden_size * (q + 2 * kv) + (q + 2 * kv) + q * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)
    n = (c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
         + c.num_hidden_layers * per_layer + c.hidden_size)
    return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len, n


def token_source(torch, path, vocab, micro, seq_len, seed):
    """A function step -> (input_ids) [micro, seq_len] on the GPU: consecutive windows of an
    llm.c token file (magic 20240520, version 1 uint16 / 2 uint32), or random ids."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if not path:
        return lambda step: torch.randint(0, vocab, (micro, seq_len), generator=gen).cuda()
    import numpy as np
    header = np.fromfile(path, dtype=np.int32, count=256)
    if header[0] != 20240520 or header[1] not in (1, 2):
        raise SystemExit(f"{SCRIPT}: {path}: not an llm.c token file (magic {header[0]}, "
                         f"version {header[1]})")
    tokens = np.memmap(path, dtype=np.uint16 if header[1] == 1 else np.uint32, mode="r",
                       offset=1024, shape=(int(header[2]),))
    window = micro * seq_len
    if len(tokens) < window:
        raise SystemExit(f"{SCRIPT}: {path}: {len(tokens)} tokens, fewer than one batch ({window})")
    if int(tokens.max()) >= vocab:
        raise SystemExit(f"{SCRIPT}: {path}: token {int(tokens.max())} is not below vocab {vocab}")

    def batch(step):
        start = (step * window) % (len(tokens) - window + 1)
        ids = np.asarray(tokens[start:start + window], dtype=np.int64).reshape(micro, seq_len)
        return torch.from_numpy(ids).cuda()
    return batch


def run_torch(torch, args, micro):
    model = build_model(torch, args.shape, args.seq_len, torch.float32)
    freeze_for(model, args.mode)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                            fused=True)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return model, step, lambda: None


def run_deepspeed(torch, args, micro):
    import deepspeed
    model = build_model(torch, args.shape, args.seq_len, torch.bfloat16)
    freeze_for(model, args.mode)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": True,
                              "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss
    # destroy() removes the ZeRO optimizer's gradient hooks and the params' links to its fp32
    # partitions, so that a try that ran out of memory leaves the halved one its memory (the
    # engine also switches Python's automatic cyclic GC off while it lives; one_try collects).
    return engine.module, step, engine.destroy


def one_try(torch, args, micro):
    """The row of one micro-batch size; raises torch.cuda.OutOfMemoryError when it does not fit."""
    gc.collect()  # what a try that ran out of memory left (its frames are gone by now)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    make = run_torch if args.system == "torch" else run_deepspeed
    model, step, close = make(torch, args, micro)
    try:
        batch = token_source(torch, args.tokens, model.config.vocab_size, micro, args.seq_len, seed=1)
        times, losses = [], []
        for s in range(args.warmup + args.steps):
            ids = batch(s)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = step(ids)
            torch.cuda.synchronize()
            if s >= args.warmup:
                times.append(time.perf_counter() - start)
                losses.append(float(loss))
            del loss
    finally:
        try:
            close()
        except Exception as exc:  # the try's own error (out of memory) is what the row reports
            print(f"{SCRIPT}: engine.destroy() failed: {peerlib.exception_text(exc)}",
                  file=sys.stderr, flush=True)
    per_token, n = flops_per_token(model.config, args.seq_len)
    seconds = statistics.median(times)
    tokens_per_s = micro * args.seq_len / seconds
    return {
        "status": "ok" if all(math.isfinite(x) for x in losses) else "error",
        "error": None if all(math.isfinite(x) for x in losses) else f"loss not finite: {losses}",
        "micro_batch": micro, "params": n, "step_seconds": seconds, "tokens_per_s": tokens_per_s,
        "mfu_989": per_token * tokens_per_s / (PEAK_BF16_TFLOPS * 1e12) if args.mode == "full"
        else None,
        "loss_first": losses[0], "loss_last": losses[-1],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "trainable_layers": "all" if args.mode == "full"
        else lisa_layers(model.config.num_hidden_layers),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=("torch", "deepspeed"), required=True)
    ap.add_argument("--shape", choices=sorted(QWEN25), required=True)
    ap.add_argument("--mode", choices=("full", "lisa"), default="full")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", help="an llm.c token file (else random token ids)")
    ap.add_argument("--jsonl", help="also append the JSON lines to this file")
    args = ap.parse_args()
    if args.micro_batch < 1 or args.seq_len < 1 or args.steps < 1 or args.warmup < 0:
        ap.error("--micro-batch, --seq-len and --steps must be at least 1, --warmup at least 0")

    torch = peerlib.need_cuda(SCRIPT)
    if args.system == "deepspeed":
        peerlib.init_nccl(torch, SCRIPT)
    base = {"workload": "train", "system": args.system, "shape": f"qwen2.5-{args.shape}",
            "mode": args.mode, "seq_len": args.seq_len, "script": SCRIPT,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    micro = args.micro_batch
    while True:
        try:
            row = one_try(torch, args, micro)
        except torch.cuda.OutOfMemoryError as exc:
            peerlib.emit(dict(base, status="oom", micro_batch=micro,
                              error=peerlib.exception_text(exc)[:300]), args.jsonl)
            if micro == 1:
                sys.exit(1)
            micro //= 2
            continue
        except Exception as exc:
            peerlib.fail(SCRIPT, peerlib.exception_text(exc), base, args.jsonl)
        peerlib.emit(dict(base, **row), args.jsonl)
        sys.exit(0 if row["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
