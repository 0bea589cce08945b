#!/usr/bin/env python3
"""Ranks the kernels of an Nsight Compute CSV (ncu --csv --metrics gpu__time_duration.sum, as
tools/bench/profile_step.sh writes it): GPU time per step by kernel and launch shape (grid and
block: a GEMM's shape shows in its grid), the share of the total, and the launches per step.

    python3 tools/bench/kernel_table.py [--steps N] [--top K] [--by name|shape|kind] [--sequence]
                                        [--segment NAME:K] FILE.csv

--by kind groups the kernels by what they do (GEMMs, attention, SwiGLU, ...: KINDS below).

--sequence lists every launch in order instead (ms, grid, block, name): to find a kernel's call
site from its neighbours. --segment NAME:K keeps only the launches after the K-th launch whose name
holds NAME, up to and with the (K+1)-th: one whole step of a program profiled from its start, cut
at a kernel it launches once a step (an optimizer's, say).
"""
import argparse
import collections
import csv
import sys

SCALE = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
         "second": 1e3, "s": 1e3}


def rows(path):
    """(kernel name, grid, block, ms) per profiled launch."""
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's own ==PROF== lines are not CSV
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r.get("Metric Unit", "nsecond")
        if unit not in SCALE:
            sys.exit(f"{path}: unknown time unit {unit!r}")
        value = float(r["Metric Value"].replace(",", ""))
        yield r["Kernel Name"], r.get("Grid Size", ""), r.get("Block Size", ""), value * SCALE[unit]


# --by kind: what a kernel does, from its name (ShardSwap's kernels, cuBLAS's and cuDNN's, and
# llm.q's for tools/peers/llmq_profile.sh), so that two programs' steps compare row by row.
KINDS = [
    ("GEMMs (cuBLAS)", ("nvjet", "splitkreduce", "gemm", "cutlass")),
    ("attention (cuDNN)", ("sdpa", "cudnn::")),
    ("SwiGLU backward", ("swiglu_backward",)),
    ("SwiGLU forward", ("swiglu_forward",)),
    ("cross-entropy", ("cross_entropy", "classifier", "mean_of", "loss_sum", "lse_stats")),
    ("RMSNorm backward", ("rmsnorm_backward", "rms_norm_backward")),
    ("RMSNorm forward", ("rmsnorm_forward", "rms_norm_forward")),
    ("RMSNorm weight and bias sums", ("norm_partials", "finish_columns", "column_partials",
                                      "bias", "reduce_add_sum")),
    ("q/k/v bias + RoPE", ("qkv_", "rope")),
    ("optimizer step", ("adamw", "global_norm", "deterministic_sum", "onerankreduce",
                        "adam_kernel", "sgd_kernel", "sum_squares")),
    ("embedding", ("embed", "encoder", "wte")),
]


def kind_of(name):
    lower = name.lower()
    for kind, parts in KINDS:
        if any(part in lower for part in parts):
            return kind
    return "other"


def segment(launches, spec):
    """The launches after the K-th whose name holds NAME, through the (K+1)-th (spec NAME:K)."""
    name, _, k = spec.rpartition(":")
    marks = [i for i, launch in enumerate(launches) if name in launch[0]]
    k = int(k)
    if not name or len(marks) < k + 2 or k < 0:
        sys.exit(f"--segment {spec}: {len(marks)} launches hold {name!r}, need {k + 2}")
    return launches[marks[k] + 1:marks[k + 1] + 1]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--steps", type=int, default=1, help="steps the capture held (divides the sums)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--by", choices=["name", "shape", "kind"], default="shape")
    p.add_argument("--sequence", action="store_true", help="every launch in order")
    p.add_argument("--segment", metavar="NAME:K", help="one step, cut at a kernel's launches")
    args = p.parse_args()
    launches = list(rows(args.csv))
    if args.segment:
        launches = segment(launches, args.segment)
    if args.sequence:
        for i, (name, grid, block, ms) in enumerate(launches):
            print(f"{i:5d} {ms:8.4f} {grid:>16} {block:>14}  {name[:160]}")
        return 0
    total = collections.Counter()
    calls = collections.Counter()
    for name, grid, block, ms in launches:
        key = (name[:140] if args.by == "name" else kind_of(name) if args.by == "kind"
               else f"{name[:140]} {grid} {block}")
        total[key] += ms
        calls[key] += 1
    if not total:
        sys.exit(f"{args.csv}: no gpu__time_duration.sum rows")
    grand = sum(total.values())
    print(f"{sum(calls.values()) / args.steps:.0f} launches, {grand / args.steps:.2f} ms of kernel "
          f"time per step ({args.steps} step(s), each kernel timed alone)")
    print(f"{'ms/step':>9} {'share':>6} {'calls':>6}  kernel (grid, block)")
    for key, ms in total.most_common(args.top):
        print(f"{ms / args.steps:9.3f} {100 * ms / grand:5.1f}% {calls[key] / args.steps:6.0f}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
