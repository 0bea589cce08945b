#!/usr/bin/env python3
"""PyTorch's fused AdamW on the GPU, the peer figure for `shardswap bench optimizer`.

Times torch.optim.AdamW(fused=True) on fp32 params split into 64 tensors (as the 2.66 ms figure in
DEVICE.md), with a device-to-device copy of 1 GiB fp32 measured in the same run for the ratio, and
checks the first step against a float64 computation before timing (a wrong result voids the row).

Bytes per param: 28 for both benchmarks. PyTorch here reads param, grad, exp_avg and exp_avg_sq
(4 x 4 bytes, fp32 gradients) and writes param, exp_avg and exp_avg_sq (3 x 4 bytes) = 28.
ShardSwap's update reads fp32 master, m, v and a bf16 gradient (14 bytes) and writes master, m, v
and a bf16 param (14 bytes) = 28 as well, so TB/s figures compare directly.

Timing as in the C++ benchmark: perf_counter around one call and torch.cuda.synchronize(); median
of --iters after 3 warm-up steps.

    python3 tools/bench/torch_adamw.py [--sizes 64M,256M,1G] [--tensors 64] [--iters 20] [--json FILE]
"""
import argparse
import json
import statistics
import sys
import time

import torch

BYTES_PER_PARAM = 28
COPY_BYTES = 1 << 30
WARMUP = 3
LR, WEIGHT_DECAY, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8


def parse_count(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    unit = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if unit != 1 else text
    if not digits.isdigit() or int(digits) == 0:
        raise SystemExit(f"torch_adamw.py: --sizes: '{text}' is not a count like 64M, 256M or 1G")
    return int(digits) * unit


def label(n):
    for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def median_seconds(fn, iters):
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy(iters):
    src = torch.randn(COPY_BYTES // 4, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), iters)
    ok = torch.equal(dst, src)
    del src, dst
    return seconds, 2 * COPY_BYTES / seconds / 1e12, ok


def measure_adamw(n, tensors, iters):
    sizes = [n // tensors + (1 if i < n % tensors else 0) for i in range(tensors)]
    gen = torch.Generator(device="cuda").manual_seed(20261129)
    params = [torch.nn.Parameter((torch.rand(s, device="cuda", generator=gen) * 2 - 1))
              for s in sizes]
    for p in params:
        p.grad = (torch.rand(p.shape, device="cuda", generator=gen) * 2 - 1) * 0.1
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                            fused=True)

    # Step 1 from zero state: p = p * (1 - lr * wd) - lr * g / (|g| + eps), checked in float64.
    sample = min(4096, sizes[0])
    p0 = params[0].detach()[:sample].double().clone()
    g0 = params[0].grad[:sample].double()
    opt.step()
    torch.cuda.synchronize()
    expected = p0 * (1 - LR * WEIGHT_DECAY) - LR * g0 / (g0.abs() + EPS)
    got = params[0].detach()[:sample].double()
    error = ((got - expected).norm() / expected.norm()).item()

    seconds = median_seconds(opt.step, iters)
    del opt, params
    torch.cuda.empty_cache()
    return seconds, BYTES_PER_PARAM * n / seconds / 1e12, error


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64M,256M,1G", help="param counts, K/M/G = powers of 1024")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_adamw.py: no CUDA device", file=sys.stderr)
        return 1
    sizes = [parse_count(s) for s in args.sizes.split(",")]

    print(f"torch {torch.__version__} fused AdamW on {torch.cuda.get_device_name()}, fp32 params in "
          f"{args.tensors} tensors, {BYTES_PER_PARAM} bytes/param; median of {args.iters} after "
          f"{WARMUP} warm-up")
    print(f"{'params':>10} {'copy TB/s':>10} {'step ms':>10} {'AdamW TB/s':>11} {'adamw/copy':>12} "
          f"{'check':>6}")
    rows, all_pass = [], True
    for n in sizes:
        copy_s, copy_tbps, copy_ok = measure_copy(args.iters)
        step_s, tbps, error = measure_adamw(n, args.tensors, args.iters)
        passed = copy_ok and error <= 1e-6
        all_pass &= passed
        print(f"{label(n):>10} {copy_tbps:>10.4g} {step_s * 1e3:>10.4g} {tbps:>11.4g} "
              f"{tbps / copy_tbps:>12.3f} {'PASS' if passed else 'FAIL':>6}", flush=True)
        rows.append({"params": n, "label": label(n), "tensors": args.tensors,
                     "copy_ms": copy_s * 1e3, "copy_tbps": copy_tbps,
                     "update_ms": step_s * 1e3, "update_tbps": tbps,
                     "ratio": tbps / copy_tbps, "check": "PASS" if passed else "FAIL",
                     "copy_ok": copy_ok, "master_error": error})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "torch_adamw_fused", "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "iters": args.iters,
                       "warmup": WARMUP, "copy_bytes": COPY_BYTES,
                       "update_bytes_per_param": BYTES_PER_PARAM, "rule": "AdamW",
                       "param_dtype": "fp32", "grad_dtype": "fp32", "rows": rows}, f, indent=2)
            f.write("\n")
    return 0 if all_pass else 1


if __name__ == "__main__":
    sys.exit(main())
