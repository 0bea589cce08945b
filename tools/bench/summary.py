#!/usr/bin/env python3
"""Prints the optimizer benchmark table from the JSON of `shardswap bench optimizer` and of
tools/bench/torch_adamw.py (same run of tools/checks/gpu-check.sh), with the ratios the issue asks for:
ShardSwap's fused update against the copy bandwidth of its own run, and against PyTorch's fused
AdamW.

    python3 tools/bench/summary.py SHARDSWAP.json TORCH.json
"""
import json
import sys


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    ours = json.load(open(sys.argv[1]))
    theirs = json.load(open(sys.argv[2]))
    torch_rows = {r["params"]: r for r in theirs["rows"]}
    print(f"device: {ours.get('device', '?')}; {ours['update_bytes_per_param']} bytes/param; "
          f"median of {ours['iters']} steps")
    header = (f"{'params':>8} {'copy TB/s':>10} {'ours ms':>9} {'ours TB/s':>10} {'ours/copy':>10} "
              f"{'torch ms':>9} {'torch TB/s':>11} {'ours/torch':>11} {'check':>6}")
    print(header)
    print("-" * len(header))
    for r in ours["rows"]:
        t = torch_rows.get(r["params"])
        check = "PASS" if r["check"] == "PASS" and (t is None or t["check"] == "PASS") else "FAIL"
        torch_ms = f"{t['update_ms']:9.3f}" if t else f"{'-':>9}"
        torch_tbps = f"{t['update_tbps']:11.2f}" if t else f"{'-':>11}"
        speedup = f"{t['update_ms'] / r['update_ms']:11.2f}" if t else f"{'-':>11}"
        print(f"{r['label']:>8} {r['copy_tbps']:10.2f} {r['update_ms']:9.3f} {r['update_tbps']:10.2f} "
              f"{r['ratio']:10.3f} {torch_ms} {torch_tbps} {speedup} {check:>6}")


if __name__ == "__main__":
    main()
