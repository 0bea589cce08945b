#!/usr/bin/env python3
"""Gathers the JSON lines of the peer scripts into one table (stdout) and one JSON file.

    python3 tools/peers/report.py RESULTS.jsonl --meta META.json [--json OUT.json]

META.json holds machine, date, versions and commit (run.sh writes it). Rows with status "error"
are listed with their error text. Exit status 1 when any row is an error, so run.sh fails loudly.
"""
import argparse
import json
import sys

import peerlib


def gib(b):
    return "-" if b is None else f"{b / 2**30:.3f}"


def mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--meta", required=True)
    ap.add_argument("--json")
    args = ap.parse_args()
    meta = json.load(open(args.meta))
    rows = peerlib.read_jsonl(args.results, "report.py")
    by = lambda w: [r for r in rows if r.get("workload") == w and r.get("status") == "ok"]
    out = []
    p = out.append
    p("peers: " + ", ".join(f"{k} {v}" for k, v in meta.items()))
    p("")
    p("a. optimizer step (28 bytes/param; ratio = step TB/s / copy TB/s of the same process)")
    p(f"{'system':<12} {'impl':<28} {'params':>11} {'ms':>8} {'TB/s':>7} {'copy':>7} {'ratio':>6} check")
    for r in by("optimizer_step"):
        p(f"{r['system']:<12} {r.get('impl', '-'):<28} {r['params']:>11} {r['step_ms']:>8.3f} "
          f"{r['tbps']:>7.3f} {r['copy_tbps']:>7.3f} {r['ratio']:>6.3f} {r.get('check', '-')}")
    p("")
    p("b. ZeRO-2 bf16 memory per rank, world size 1 over NCCL (GiB)")
    p(f"{'system':<12} {'params':>11} {'plan':>8} {'peak':>8} {'steady':>8} {'formula':>8}")
    for r in by("zero2_memory"):
        p(f"{r['system']:<12} {r['params']:>11} {gib(r.get('plan_total_bytes')):>8} "
          f"{gib(r.get('peak_bytes')):>8} {gib(r.get('steady_bytes')):>8} "
          f"{gib(r.get('zero_formula_bytes')):>8}")
    p("")
    p("c. seed 000: peak memory with gradient compression (MiB; grads = fp32 gradient bytes)")
    p(f"{'system':<12} {'model':<7} {'comm':<5} {'world':>5} {'params':>11} {'grads':>9} "
      f"{'allocated':>10} {'peak':>10}")
    for r in by("compress_peak"):
        p(f"{r['system']:<12} {r['model']:<7} {r['hook']:<5} {r['world_size']:>5} "
          f"{r['params']:>11} {mib(r['grad_bytes']):>9} {mib(r['allocated_bytes']):>10} "
          f"{mib(r.get('peak_bytes_max_over_ranks', r['peak_bytes'])):>10}")
    p("")
    p("d. seed 004: switching 2 of 32 layers (ms per switch; allocated GiB after 1 and N switches)")
    p(f"{'system':<12} {'method':<44} {'ms':>9} {'after 1':>8} {'after N':>8} {'N':>4}")
    # A failed switching run (out of memory) still shows how far it got, marked "failed".
    for r in (r for r in rows if r.get("workload") == "lisa_switch" and "switches" in r):
        failed = "" if r.get("status") == "ok" else "  failed"
        p(f"{r['system']:<12} {r['method'][:44]:<44} {fmt(r.get('ms_per_switch'), '9.3f'):>9} "
          f"{gib(r.get('allocated_after_1_step_bytes')):>8} "
          f"{gib(r.get('allocated_after_n_steps_bytes')):>8} {r['switches']:>4}{failed}")
    errors = [r for r in rows if r.get("status") != "ok"]
    notes = [r for r in rows if r.get("fused_adam_error")]
    if notes:
        p("")
        p("DeepSpeed FusedAdam could not load; torch_adam used. Error:")
        p("  " + notes[0]["fused_adam_error"].replace("\n", "\n  "))
    if errors:
        p("")
        p(f"{len(errors)} row(s) failed:")
        for r in errors:
            p(f"  {r.get('workload')} / {r.get('system')} {r.get('model', '')} "
              f"{r.get('hook', '')}: {r.get('error')}")
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "table": out}, f, indent=2)
            f.write("\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
