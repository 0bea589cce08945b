#!/usr/bin/env python3
"""Do two `shardswap train --metrics` files hold the same run? Every field of every record must be
equal, bit for bit, but the timings and the driver's free-memory sample, which vary run to run
(step_seconds, tokens_per_s, phase_seconds, device_free_bytes, device_total_bytes, a switch's
seconds). Prints "identical: ..." with the first and last loss, or where they first differ.

    python3 tools/checks/metrics_same.py A.jsonl B.jsonl [--differ-ok]

Exit 0 when identical, 1 when not (or a file is empty); --differ-ok reports a difference and exits
0 (for pairs that are expected to differ, such as cuDNN's atomic attention backward).
"""
import argparse
import json
import sys

TIMING = {"step_seconds", "tokens_per_s", "phase_seconds", "device_free_bytes",
          "device_total_bytes"}


def records(path):
    out = []
    for line in open(path):
        r = json.loads(line)
        if "switch" in r:
            r["switch"] = {k: v for k, v in r["switch"].items() if k != "seconds"}
        out.append({k: v for k, v in r.items() if k not in TIMING})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--differ-ok", action="store_true", help="report a difference, exit 0")
    args = p.parse_args()
    a, b = records(args.a), records(args.b)
    differ = 0 if args.differ_ok else 1
    if not a or len(a) != len(b):
        print(f"  {len(a)} and {len(b)} records")
        return 1
    for x, y in zip(a, b):
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k):
                print(f"  differ first at step {x.get('step')}, {k}: {x.get(k)} vs {y.get(k)}; "
                      f"last loss {a[-1].get('loss')} vs {b[-1].get('loss')}")
                return differ
    losses = [r["loss"] for r in a if "loss" in r]
    print(f"  identical: {len(a)} records, every field but the timings; loss {losses[0]} -> "
          f"{losses[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
