#!/usr/bin/env python3
"""Decoder training benchmark on one GPU: `shardswap train` of Qwen2.5-shaped models from scratch,
full fine-tune and LISA, with `logging.timing` on, and one table of what a user compares.

Each row is one run of configs/qwen2.5-SHAPE.json at seq_len 2048 (bf16 compute, fp32 master and
Adam state, ZeRO-2 at world size 1 over NCCL) on real tokens: the bytes of a text file (--text, or
the Python sources of this interpreter's standard library, concatenated). LISA keeps the
embedding, the final norm with the head and two layers active (layer_switching gamma 2, no switch
during the run). Columns:
  tokens/s   median over the steps after --warmup (from the metrics' tokens_per_s)
  MFU        (6 N + 12 L H seq) FLOPs a token x tokens/s over 989 TFLOP/s (bf16 dense, H100/H200
             SXM nominal); N counts every matrix the step multiplies by (a tied embedding once,
             as the head; an untied embedding's lookup not); full fine-tunes only
  of cuBLAS  the model's GEMM rate (forward + backward GEMM FLOPs over their time) against the
             cuBLAS rate of the model's largest GEMM measured in the same run
  split      median ms per step of each phase (phase_seconds): forward (embedding, norms,
             q/k/v/o, RoPE), forward MLP, attention forward, head and loss, backward MLP,
             backward (the rest), attention backward, engine.step(), host and gaps
  plan/peak  rank 0's predicted and measured peak (MiB)
A row is void unless the loss is finite at every step and its last five steps' mean is below the
first step's.

    python3 tools/bench/train_bench.py --bin build/cuda/tools/shardswap --out DIR \\
        [--shapes 0.5b,1.5b] [--modes full,lisa] [--steps 30] [--warmup 5] [--micro 0.5b=8,1.5b=4]
        [--global-batch N] [--documents LO-HI] [--set KEY=VALUE ...]
Writes DIR/train-bench.json and each run's log and metrics; prints the table.
"""
import argparse
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys
import sysconfig

PEAK_TFLOPS = 989.0
# The peers' anchors' micro-batches; 7B: 3, the most that fits on a 141 GB GPU without
# recomputation (`shardswap plan` at seq 2048: 145,374,479,112 bytes at micro 3,
# 152,996,864,776 at 4; 129,415,111,432 at 4 with model.recompute_layers = 28).
MICRO = {"0.5b": 8, "1.5b": 4, "3b": 4, "7b": 3, "14b": 3}
PHASES = ["forward", "forward MLP", "attention forward", "head and loss", "backward MLP",
          "backward", "attention backward", "engine.step()", "host and gaps"]


def failure_line(text_log):
    """The line that says why a run stopped: its first "error:" line (a refused allocation is
    followed by the memory report's lines), else its last."""
    lines = text_log.strip().splitlines()
    errors = [l for l in lines if "error:" in l]
    return (errors[0] if errors else lines[-1]) if lines else ""


def text_file(out, given):
    """One file of real text, at least 16 MiB: the bytes tokenizer reads one file."""
    if given:
        return given
    path = os.path.join(out, "bench-text.txt")
    if os.path.exists(path):
        return path
    with open(path, "wb") as f:
        size = 0
        for src in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"),
                                    recursive=True)):
            data = open(src, "rb").read()
            f.write(data)
            size += len(data)
            if size >= 16 << 20:
                break
    return path


def document_files(out, text, lengths, seed=1):
    """The text's bytes as token files of documents (llm.c's format, version 1, with ShardSwap's
    loss mask: every token a target, bit 1 where a document starts; tools/data/token_data.h):
    documents of LO to HI tokens, uniform, the last 5% of the bytes for validation. Returns the
    train and validation paths. (Chat files from tokenize_data.py --chat are marked the same
    way; these need no tokenizer.)"""
    import random
    import struct
    lo, hi = (int(x) for x in lengths.split("-"))
    data = open(text, "rb").read()
    cut = len(data) * 95 // 100
    rng = random.Random(seed)
    paths = []
    for name, part in (("train", data[:cut]), ("val", data[cut:])):
        path = os.path.join(out, f"bench-docs-{lo}-{hi}-{name}.bin")
        paths.append(path)
        if os.path.exists(path):
            continue
        mask = bytearray(b"\x01" * len(part))  # every token a target
        at = 0
        while at < len(part):
            mask[at] = 3  # and a document's first
            at += rng.randint(lo, hi)
        tokens = bytearray(2 * len(part))  # little-endian uint16: the byte, then 0
        tokens[0::2] = part
        header = struct.pack("<256i", 20240520, 1, len(part), 1, *([0] * 252))
        with open(path, "wb") as f:
            f.write(header + tokens + mask)
    return paths


def model_of(shape):
    config = json.load(open(f"configs/qwen2.5-{shape}.json"))
    return config["model"]


def flops_per_token(m, seq_len):
    """6 N + 12 L H seq, N the multiplied weights (see the module's docstring)."""
    d, i, layers, v = (m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"],
                       m["vocab_size"])
    hd = m.get("head_dim", d // m["num_attention_heads"])
    q, kv = m["num_attention_heads"] * hd, m["num_key_value_heads"] * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * i
    n = layers * per_layer + v * d  # the head (tied or not); the lookup is no matmul
    return 6 * n + 12 * layers * d * seq_len


def run(args, shape, mode, text):
    name = f"{shape}-{mode}"
    metrics = os.path.join(args.out, f"train-bench-{name}.jsonl")
    log = os.path.join(args.out, f"train-bench-{name}.log")
    micro = args.micro.get(shape, MICRO[shape])
    sets = {"steps": args.steps, "data.seq_len": 2048, "data.train": text,
            "logging.timing": "true", "logging.eval_interval": 100000, "logging.eval_batches": 1,
            "logging.interval": args.steps}
    if args.documents:  # token files of documents, kept apart unless --set says packed
        train, val = document_files(args.out, text, args.documents)
        sets.update({"data.tokenizer": "llmc", "data.train": train, "data.val": val})
    if micro > 0:  # 0: the config's batch keys as they are (--global-batch)
        sets["train_micro_batch_size_per_gpu"] = micro
    config = f"configs/qwen2.5-{shape}.json"
    if mode == "lisa":
        config = f"configs/qwen2.5-{shape}-lisa.json"
        sets.update({"layer_switching.gamma": 2, "layer_switching.interval": 100000})
    if args.global_batch:
        # The global batch alone: the config copied without its micro-batch and accumulation,
        # so that a device budget may choose the micro-batch (docs/memory.md).
        source = json.load(open(config))
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            source.pop(key, None)
        source["train_batch_size"] = args.global_batch
        config = os.path.join(args.out, f"config-{name}.json")
        json.dump(source, open(config, "w"), indent=1)
        sets.pop("train_micro_batch_size_per_gpu", None)
    cmd = [args.bin, "train", "--config", config, "--metrics", metrics]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    for kv in args.set:
        cmd += ["--set", kv]
    row = {"shape": shape, "mode": mode, "micro": micro, "seq_len": 2048}
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        row["void"] = f"did not finish in --timeout {args.timeout} s"
        return row
    text_log = open(log).read()
    row["rc"] = rc
    if rc != 0:
        row["void"] = "exit %d: %s" % (rc, failure_line(text_log))
        return row
    lines = [json.loads(l) for l in open(metrics)]
    losses = [l["loss"] for l in lines]
    timed = lines[args.warmup:]
    row["tokens_per_s"] = statistics.median(l["tokens_per_s"] for l in timed)
    row["loss_first"], row["loss_last5"] = losses[0], statistics.fmean(losses[-5:])
    if not all(math.isfinite(x) for x in losses) or not row["loss_last5"] < row["loss_first"]:
        row["void"] = "loss not finite or not falling"
    row["split_ms"] = {p: 1e3 * statistics.median(l["phase_seconds"].get(p, 0.0) for l in timed)
                       for p in PHASES if timed and "phase_seconds" in timed[0]}
    m = re.search(r"micro-batch (\d+)", text_log)
    if args.global_batch and m:  # what the run chose
        row["micro"] = int(m.group(1))
    m = re.search(r"rank 0 peak ([\d.]+) MiB, predicted ([\d.]+) MiB", text_log)
    if m:
        row["peak_mib"], row["plan_mib"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"cuBLAS \w+ GEMM (\d+) x (\d+) x (\d+): ([\d.]+) TFLOP/s", text_log)
    if m:
        row["cublas_tflops"] = float(m.group(4))
    m = re.search(r"model forward\+backward ([\d.]+) TFLOP/s of GEMM work", text_log)
    if m:
        row["model_gemm_tflops"] = float(m.group(1))
    if mode == "full":
        row["mfu"] = flops_per_token(model_of(shape), 2048) * row["tokens_per_s"] / (PEAK_TFLOPS * 1e12)
    return row


def print_table(rows):
    head = (f"{'shape':>6} {'mode':>5} {'micro':>5} {'tokens/s':>9} {'MFU':>6} {'GEMM/cuBLAS':>11} "
            f"{'plan MiB':>9} {'peak MiB':>9}  split ms: " + ", ".join(PHASES))
    print(head)
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['shape']:>6} {r['mode']:>5} {r['micro']:>5}  VOID: {r.get('void')}")
            continue
        mfu = f"{100 * r['mfu']:5.1f}%" if "mfu" in r else f"{'-':>6}"
        share = (f"{100 * r['model_gemm_tflops'] / r['cublas_tflops']:10.1f}%"
                 if "model_gemm_tflops" in r and "cublas_tflops" in r else f"{'-':>11}")
        split = " / ".join(f"{r['split_ms'][p]:.1f}" for p in PHASES if p in r.get("split_ms", {}))
        void = f"  VOID: {r['void']}" if "void" in r else ""
        print(f"{r['shape']:>6} {r['mode']:>5} {r['micro']:>5} {r['tokens_per_s']:9.0f} {mfu} {share} "
              f"{r.get('plan_mib', 0):9.1f} {r.get('peak_mib', 0):9.1f}  {split}{void}")
    by = {(r["shape"], r["mode"]): r for r in rows if "tokens_per_s" in r}
    for (shape, mode), r in sorted(by.items()):
        if mode == "lisa" and (shape, "full") in by:
            print(f"{shape}: LISA / full tokens/s = {r['tokens_per_s'] / by[(shape, 'full')]['tokens_per_s']:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default="build/cuda/tools/shardswap")
    p.add_argument("--out", required=True, help="folder for the logs, metrics and train-bench.json")
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--modes", default="full,lisa")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro", default="", help="shape=N,... (default: 0.5b=8, 1.5b=4, 3b=4, 7b=3, 14b=3)")
    p.add_argument("--text", default="", help="a text file whose bytes are the tokens")
    p.add_argument("--global-batch", type=int, default=0,
                   help="give the configs train_batch_size N alone (no micro-batch or "
                        "accumulation), e.g. for a device budget to choose the micro-batch")
    p.add_argument("--documents", default="", metavar="LO-HI",
                   help="train on the text cut into documents of LO to HI tokens, marked as "
                        "--chat files mark theirs (data.documents then defaults to apart)")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (e.g. gradient_accumulation_steps=4)")
    args = p.parse_args()
    args.micro = {k: int(v) for k, v in (x.split("=") for x in args.micro.split(",") if x)}
    os.makedirs(args.out, exist_ok=True)
    text = text_file(args.out, args.text)
    rows = []
    for shape in args.shapes.split(","):
        for mode in args.modes.split(","):
            rows.append(run(args, shape, mode, text))
            print(json.dumps(rows[-1]), flush=True)
    json.dump({"rows": rows}, open(os.path.join(args.out, "train-bench.json"), "w"), indent=1)
    print_table(rows)
    return 0 if all("void" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
