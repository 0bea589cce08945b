#!/usr/bin/env python3
"""The ShardSwap rows of the peer comparison, through the `shardswap` CLI (no C++ added).

    python3 tools/peers/shardswap_side.py optimizer --sizes 64M,256M
    python3 tools/peers/shardswap_side.py memory    [--hidden-size 2048 --intermediate-size 8192
                                                     --num-hidden-layers 18 --num-attention-heads 16
                                                     --num-key-value-heads 8 --seq-len 128]
    python3 tools/peers/shardswap_side.py compress  --shape linear|stack --comm fp16|fp32 [--world N]
    python3 tools/peers/shardswap_side.py switch    [--layers 32 --dim 4096 --switches 100]

Each runs build/cuda/tools/shardswap (or --bin), parses what it writes (its --json / --metrics files
and plan's text) and prints JSON lines like the peer scripts. A non-zero exit of the CLI fails the
row loudly with its last output lines.

memory and compress use configs/gpu-300m.json (a byte decoder) with --set overrides: the model keys
make the decoder hold exactly the params of ds_zero2_memory.py's model (peerlib.DecoderLike); layer switching off, so every group is
active as in the peers. Memory figures are the engine's own accounting (requested bytes by tag,
rank 0, metrics' memory_bytes: current `total` after the last step and `peak` over the steps) and
the plan's `total` row, not cudaMalloc totals: cuBLAS workspace and CUDA context are outside both
sides' figures (torch's memory_allocated excludes them too).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import peerlib

SCRIPT = "shardswap_side.py"
CONFIG = "configs/gpu-300m.json"


def run_cli(args, cmd, record):
    """Runs the CLI; on failure emits an error row quoting its output's tail and exits 1."""
    if cmd[0] in ("plan", "train"):
        for kv in args.extra_set:
            cmd = cmd + ["--set", kv]
    proc = subprocess.run([args.bin] + cmd, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(text.strip().splitlines()[-15:])
        peerlib.fail(SCRIPT, f"shardswap {' '.join(cmd)} exited {proc.returncode}: {tail}",
                     record, args.jsonl)
    return text


def model_sets(shape, seq_len):
    sets = []
    for key, value in zip(peerlib.DecoderLike.KEYS, shape):
        sets += ["--set", f"model.{key}={value}"]
    return sets + ["--set", f"data.seq_len={seq_len}",
                   "--set", f"model.max_position_embeddings={max(seq_len, 1024)}",
                   "--set", "layer_switching.type=none", "--set", "logging.eval_interval=1000000",
                   "--set", "logging.timing=false"]


def last_metrics(path):
    with open(path) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    if not lines:
        raise RuntimeError(f"{path}: no metrics written")
    return lines


def cmd_optimizer(args):
    base = {"workload": "optimizer_step", "system": "shardswap", "script": SCRIPT,
            "impl": "shardswap_fused_adamw_bf16"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "opt.json")
        run_cli(args, ["bench", "optimizer", "--backend", args.backend, "--sizes", args.sizes,
                       "--iters", str(args.iters), "--json", out], base)
        doc = json.load(open(out))
    status = 0
    for row in doc["rows"]:
        ok = row["check"] == "PASS"
        status |= 0 if ok else 1
        peerlib.emit(dict(base, params=row["params"], step_ms=row["update_ms"],
                          tbps=row["update_tbps"], copy_tbps=row["copy_tbps"],
                          ratio=row["ratio"], check=row["check"],
                          master_error=row["master_error"], status="ok" if ok else "error",
                          error=None if ok else "shardswap bench check FAIL"), args.jsonl)
    return status


def cmd_memory(args):
    shape = [getattr(args, k) for k in peerlib.DecoderLike.KEYS]
    params = peerlib.DecoderLike.param_count(*shape)
    base = {"workload": "zero2_memory", "system": "shardswap", "script": SCRIPT, "params": params,
            "model": dict(zip(peerlib.DecoderLike.KEYS, shape)), "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "world_size": 1}
    sets = model_sets(shape, args.seq_len) + [
        "--set", "world_size=1", "--set", "shardswap.communicator=nccl",
        "--set", f"train_micro_batch_size_per_gpu={args.micro_batch}",
        "--set", f"steps={args.steps}"]
    plan = run_cli(args, ["plan", "--config", CONFIG] + sets, base)
    m = re.search(r"plan: decoder, (\d+) params", plan)
    total = re.search(r"^total\s+(\d+)", plan, re.M)
    if not m or not total:
        peerlib.fail(SCRIPT, "plan output not understood:\n" + plan[-1500:], base, args.jsonl)
    if int(m.group(1)) != params:
        peerlib.fail(SCRIPT, f"plan says {m.group(1)} params, peers hold {params}", base,
                     args.jsonl)
    plan_rows = {k: int(v) for k, v in re.findall(r"^(\w+)\s+(\d+)\s+\d+\s*$", plan, re.M)}
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        log = run_cli(args, ["train", "--config", CONFIG, "--metrics", metrics] + sets, base)
        lines = last_metrics(metrics)
    mem = lines[-1]["memory_bytes"]
    peerlib.emit(dict(base, status="ok", plan_total_bytes=int(total.group(1)),
                      plan_by_tag=plan_rows, steady_bytes=mem["total"],
                      peak_bytes=max(l["memory_bytes"]["peak"] for l in lines),
                      memory_bytes_last=mem, zero_formula_bytes=2 * params + 14 * params,
                      step_ms_median=sorted(l["step_seconds"] for l in lines)[len(lines) // 2]
                      * 1e3, loss_first=lines[0]["loss"], loss_last=lines[-1]["loss"],
                      log_tail=log.strip().splitlines()[-3:]), args.jsonl)
    return 0


def cmd_compress(args):
    # The decoders nearest the peers' models: one layer with 512 x 4096 MLP matrices, and 1.07B
    # params in 4 layers of 4096 x 16384 ones.
    shape = {"linear": (512, 4096, 1, 4, 4), "stack": (4096, 16384, 4, 32, 32)}[args.shape]
    params = peerlib.DecoderLike.param_count(*shape)
    base = {"workload": "compress_peak", "system": "shardswap", "script": SCRIPT,
            "model": args.shape, "hook": args.comm, "params": params, "world_size": args.world,
            "dtype": "bf16 params, fp32 grads",
            "decoder": dict(zip(peerlib.DecoderLike.KEYS, shape)), "seq_len": 64}
    sets = model_sets(shape, 64) + [
        "--set", f"world_size={args.world}", "--set", "shardswap.communicator=nccl",
        "--set", "data_types.grad_accum_dtype=fp32",
        "--set", f"communication_data_type={args.comm}",
        "--set", "train_micro_batch_size_per_gpu=16", "--set", "steps=5"]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        run_cli(args, ["train", "--config", CONFIG, "--metrics", metrics] + sets, base)
        lines = last_metrics(metrics)
    peerlib.emit(dict(base, status="ok", grad_bytes=4 * params,
                      allocated_bytes=lines[-1]["memory_bytes"]["total"],
                      peak_bytes=max(l["memory_bytes"]["peak"] for l in lines),
                      memory_bytes_last=lines[-1]["memory_bytes"]), args.jsonl)
    return 0


def cmd_switch(args):
    base = {"workload": "lisa_switch", "system": "shardswap", "script": SCRIPT,
            "layers": args.layers, "dim": args.dim, "active": 2}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sw.json")
        text = run_cli(args, ["bench", "switch", "--backend", args.backend, "--layers", str(args.layers),
                              "--dim", str(args.dim), "--switches", str(args.switches),
                              "--json", out], base)
        doc = json.load(open(out))
    for row in doc["rows"]:
        ok = row["check"] == "PASS"
        # The bench's extra keep_host row pins and unpins host memory at every switch (the cache
        # emptied after each free): what keep_host cost before the pinned host cache.
        label = row["policy"] + ("" if row.get("host_cache", True) else " (no cache)")
        peerlib.emit(dict(base, method=f"set_active, policy {label}",
                          policy=label, switches=args.switches,
                          ms_per_switch=row["ms_per_switch"], bytes_touched=row["bytes"],
                          bound_ms=row["bound_ms"], copy_tbps=row["copy_tbps"],
                          # ShardSwap's requested bytes after the first timed switch and after
                          # the last (shardswap bench switch); no training step in between.
                          allocated_after_1_step_bytes=row.get("allocated_after_1_bytes"),
                          allocated_after_n_steps_bytes=row.get("allocated_after_n_bytes"),
                          check=row["check"], status="ok" if ok else "error",
                          error=None if ok else "memory stats != plan after the switches",
                          note="allocated bytes equal the plan after all switches (check)"),
                     args.jsonl)
    return 0 if all(r["check"] == "PASS" for r in doc["rows"]) else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default="build/cuda/tools/shardswap")
    ap.add_argument("--jsonl", help="also append the JSON lines to this file")
    ap.add_argument("--extra-set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more --set for train/plan, applied last (e.g. the CPU check: "
                    "shardswap.backend=cpu, shardswap.communicator=in_process)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("optimizer")
    p.add_argument("--sizes", default="64M,256M")
    p.add_argument("--backend", default="cuda", help="cpu: this folder's CPU-only check")
    p.add_argument("--iters", type=int, default=20)
    p = sub.add_parser("memory")
    peerlib.DecoderLike.add_args(p, peerlib.DecoderLike.MEMORY_SHAPE)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p = sub.add_parser("compress")
    p.add_argument("--shape", choices=("linear", "stack"), required=True)
    p.add_argument("--comm", choices=("fp16", "fp32", "bf16"), required=True)
    p.add_argument("--world", type=int, default=1)
    p = sub.add_parser("switch")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--switches", type=int, default=100)
    p.add_argument("--backend", default="cuda", help="cpu: this folder's CPU-only check")
    args = ap.parse_args()
    if not (os.path.isfile(args.bin) and os.access(args.bin, os.X_OK)):
        peerlib.fail(SCRIPT, f"{args.bin}: no shardswap binary (build build/cuda first: "
                     "bash tools/checks/gpu-check.sh quick, or cmake --preset cuda && cmake --build "
                     "--preset cuda --target shardswap_cli)", {"workload": args.cmd,
                                                           "system": "shardswap"}, args.jsonl)
    return {"optimizer": cmd_optimizer, "memory": cmd_memory, "compress": cmd_compress,
            "switch": cmd_switch}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
