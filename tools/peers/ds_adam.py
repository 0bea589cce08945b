#!/usr/bin/env python3
"""Workload a: DeepSpeed's FusedAdam step on the GPU, beside tools/bench/torch_adamw.py.

Same layout as torch_adamw.py: fp32 params in --tensors tensors, fp32 gradients, AdamW (decoupled
weight decay), 28 bytes moved per param (reads param, grad, exp_avg, exp_avg_sq; writes param,
exp_avg, exp_avg_sq), a 1 GiB device copy measured in the same process for the ratio, and the first
step checked against float64 before timing. FusedAdam's CUDA op is JIT-built on first use by
torch.utils.cpp_extension; if that fails the exact error is recorded and, unless --no-fallback,
the row is measured with torch.optim.AdamW(foreach=False, fused=False), which is what DeepSpeed's
`torch_adam: true` selects (the row says so: impl "torch_adam_fallback").

    python3 tools/peers/ds_adam.py [--sizes 64M,256M] [--tensors 64] [--iters 20] [--jsonl FILE]
"""
import argparse
import sys
import time

import peerlib

SCRIPT = "ds_adam.py"
BYTES_PER_PARAM = 28
LR, WEIGHT_DECAY, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8


def make_optimizer(torch, params, no_fallback, notes):
    """FusedAdam, or the torch_adam fallback with the build error kept in notes."""
    try:
        from deepspeed.ops.adam import FusedAdam
        started = time.perf_counter()
        opt = FusedAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                        adam_w_mode=True)
        notes["fused_adam_load_s"] = time.perf_counter() - started
        return opt, "deepspeed_fused_adam"
    except Exception as exc:  # the op build or import: recorded verbatim
        notes["fused_adam_error"] = peerlib.exception_text(exc)
        if no_fallback:
            raise
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                foreach=False, fused=False)
        return opt, "torch_adam_fallback"


def measure(torch, n, tensors, iters, no_fallback):
    sizes = [n // tensors + (1 if i < n % tensors else 0) for i in range(tensors)]
    gen = torch.Generator(device="cuda").manual_seed(20261129)
    params = [torch.nn.Parameter(torch.rand(s, device="cuda", generator=gen) * 2 - 1)
              for s in sizes]
    for p in params:
        p.grad = (torch.rand(p.shape, device="cuda", generator=gen) * 2 - 1) * 0.1
    notes = {}
    opt, impl = make_optimizer(torch, params, no_fallback, notes)

    # Step 1 from zero state: p * (1 - lr wd) - lr g / (|g| + eps), in float64.
    sample = min(4096, sizes[0])
    p0 = params[0].detach()[:sample].double().clone()
    g0 = params[0].grad[:sample].double()
    opt.step()
    torch.cuda.synchronize()
    expected = p0 * (1 - LR * WEIGHT_DECAY) - LR * g0 / (g0.abs() + EPS)
    got = params[0].detach()[:sample].double()
    error = ((got - expected).norm() / expected.norm()).item()

    seconds = peerlib.median_seconds(opt.step, iters, torch.cuda.synchronize)
    del opt, params
    torch.cuda.empty_cache()
    return impl, seconds, error, notes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64M,256M", help="param counts, K/M/G = powers of 1024")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-fallback", action="store_true",
                    help="fail instead of measuring torch's AdamW when FusedAdam cannot load")
    ap.add_argument("--jsonl", help="also append the JSON lines to this file")
    args = ap.parse_args()
    sizes = [peerlib.parse_count(s, SCRIPT) for s in args.sizes.split(",")]
    if args.tensors < 1 or args.iters < 1:
        ap.error("--tensors and --iters must be >= 1")
    base = {"workload": "optimizer_step", "system": "deepspeed", "script": SCRIPT}
    torch = peerlib.need_cuda(SCRIPT)
    try:
        import deepspeed
        base["deepspeed"] = deepspeed.__version__
    except Exception as exc:
        peerlib.fail(SCRIPT, "import deepspeed: " + peerlib.exception_text(exc), base, args.jsonl)
    base["torch"] = torch.__version__
    status = 0
    for n in sizes:
        copy = peerlib.copy_tbps(torch, args.iters)
        try:
            impl, seconds, error, notes = measure(torch, n, args.tensors, args.iters,
                                                  args.no_fallback)
        except Exception as exc:
            peerlib.fail(SCRIPT, peerlib.exception_text(exc), dict(base, params=n), args.jsonl)
        tbps = BYTES_PER_PARAM * n / seconds / 1e12
        passed = error <= 1e-6
        status |= 0 if passed else 1
        peerlib.emit(dict(base, impl=impl, params=n, tensors=args.tensors, step_ms=seconds * 1e3,
                          tbps=tbps, copy_tbps=copy, ratio=tbps / copy, master_error=error,
                          check="PASS" if passed else "FAIL", status="ok", **notes), args.jsonl)
    return status


if __name__ == "__main__":
    sys.exit(main())
