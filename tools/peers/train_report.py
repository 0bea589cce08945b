#!/usr/bin/env python3
"""ShardSwap's decoder training beside transformers + PyTorch and DeepSpeed ZeRO-2: one table.

    python3 tools/peers/train_report.py --bench OUT/train-bench.json --peers OUT/peers-train.jsonl \\
        [--json OUT/train-side-by-side.json] [--shapes 0.5b,1.5b] [--modes full,lisa] \\
        [--require shardswap,torch,deepspeed]

Reads what tools/bench/train_bench.py writes (train-bench.json: {"rows": [{shape, mode, micro,
tokens_per_s, peak_mib, void?, ...}]}) and the JSON lines of tools/peers/train_throughput.py
(system torch / deepspeed, shape qwen2.5-SHAPE, mode, status ok / oom / error, micro_batch,
tokens_per_s, peak_gib). One line per shape and mode: the micro-batch, tokens/s of each system (a
peer that ran out of memory and fitted at a halved micro-batch shows it, "tokens/s @micro"; one
that never fitted shows "oom at 8,4,2,1"), ShardSwap / peer tokens/s, and the peak memory of each
in MiB (ShardSwap: the engine's rank 0 peak; peers: torch's max_memory_allocated); then LISA /
full tokens/s per shape and system. Machine (nvidia-smi), date, versions and commit (git
rev-parse --short HEAD, else $PEERS_COMMIT) go into the --json file with the table and every
input row. Exit status 1 when any row failed: a ShardSwap row that is void, a peer cell without a
timed run, or no row at all for a required system (--require) at a shape and mode asked for
(--shapes x --modes; without them every shape and mode shown). Rows of other shapes and modes
found in the files (an earlier run into the same folder) are shown too.
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import peerlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEMS = ("shardswap", "torch", "deepspeed")
NAMES = {"shardswap": "ShardSwap", "torch": "PyTorch", "deepspeed": "DeepSpeed"}
SHORT = {"torch": "PT", "deepspeed": "DS"}
SHAPE_ORDER = ("0.5b", "1.5b", "3b", "7b")
MODE_ORDER = ("full", "lisa")


def sh(cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def meta():
    gpus = []
    for line in (sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                     "--format=csv,noheader"]) or "").splitlines():
        name, memory, driver = (x.strip() for x in (line.split(",") + ["", ""])[:3])
        gpus.append({"name": name, "memory": memory, "driver": driver})
    if gpus:
        names = sorted({g["name"] for g in gpus})
        machine = f"{len(gpus)} x {' + '.join(names)} ({gpus[0]['memory']} each)"
    else:
        machine = "unknown (nvidia-smi did not answer)"
    commit = sh(["git", "rev-parse", "--short", "HEAD"])
    dirty = None
    if commit:
        changes = sh(["git", "status", "--porcelain", "--untracked-files=no"])
        dirty = bool(changes) if changes is not None else None
    else:
        commit = os.environ.get("PEERS_COMMIT") or "unknown"
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "deepspeed"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"machine": machine, "gpus": gpus, "driver": gpus[0]["driver"] if gpus else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "uncommitted_changes": dirty, "versions": versions}


def load_bench(path):
    if not path or not os.path.exists(path):
        return None
    try:
        rows = json.load(open(path))["rows"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SystemExit(f"train_report.py: {path}: not train_bench.py's output ({exc})")
    return {(r["shape"], r["mode"]): r for r in rows}


def load_peers(path):
    if not path or not os.path.exists(path):
        return []
    return peerlib.read_jsonl(path, "train_report.py")


def shape_of(row):
    s = row.get("shape") or ""
    return s[len("qwen2.5-"):] if s.startswith("qwen2.5-") else s


def shardswap_cell(r):
    """(cell dict, failure or None) of one train_bench.py row (None when the row is absent)."""
    if r is None:
        return None, "no row"
    cell = {"tokens_per_s": r.get("tokens_per_s"), "micro": r.get("micro"),
            "peak_mib": r.get("peak_mib"), "plan_mib": r.get("plan_mib"), "mfu": r.get("mfu")}
    if "void" in r:
        cell["void"] = r["void"]
        return cell, f"void: {r['void']}"
    if r.get("tokens_per_s") is None:
        return cell, "no tokens/s"
    return cell, None


def peer_cell(rows):
    """(cell dict, failure or None) from one system's rows of one shape and mode (None: absent)."""
    if not rows:
        return None, "no row"
    tried = [r.get("micro_batch") for r in rows if r.get("micro_batch") is not None]
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s") is not None]
    oom = sorted({r["micro_batch"] for r in rows if r.get("status") == "oom"
                  and r.get("micro_batch") is not None}, reverse=True)
    errors = [r for r in rows if r.get("status") not in ("ok", "oom")]
    cell = {"first_micro": max(tried) if tried else None, "oom_at": oom}
    if ok:
        r = ok[-1]
        peak = r.get("peak_gib")
        cell.update(tokens_per_s=r["tokens_per_s"], micro=r.get("micro_batch"),
                    peak_mib=None if peak is None else peak * 1024.0,
                    step_seconds=r.get("step_seconds"), loss_first=r.get("loss_first"),
                    loss_last=r.get("loss_last"))
        return cell, None
    if errors:
        cell["error"] = str(errors[-1].get("error"))
        return cell, cell["error"]
    return cell, "out of memory at micro-batch " + ",".join(map(str, oom))


def fmt_tps(cell, want_micro):
    if cell is None:
        return "-"
    if cell.get("tokens_per_s") is None:
        if cell.get("void"):
            return "void"
        if cell.get("error") is not None:
            return "error"
        if cell.get("oom_at"):
            return "oom at " + ",".join(map(str, cell["oom_at"]))
        return "-"
    text = f"{cell['tokens_per_s']:.0f}"
    if cell.get("void"):
        text += " void"
    if want_micro is not None and cell.get("micro") is not None and cell["micro"] != want_micro:
        text += f" @{cell['micro']}"
    return text


def ratio(a, b):
    if a is None or b is None or a.get("tokens_per_s") is None or b.get("tokens_per_s") is None:
        return None
    return a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] > 0 else None


def fmt(x, spec, none="-"):
    return none if x is None else format(x, spec)


def order(keys):
    def k(key):
        shape, mode = key
        return (SHAPE_ORDER.index(shape) if shape in SHAPE_ORDER else len(SHAPE_ORDER), shape,
                MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)
    return sorted(keys, key=k)


def split(text):
    return [x for x in (text or "").split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, help="train_bench.py's train-bench.json")
    ap.add_argument("--peers", required=True, help="train_throughput.py's JSON lines")
    ap.add_argument("--json", help="write table, rows and machine/date/commit here")
    ap.add_argument("--shapes", default="", help="shapes that must have rows (e.g. 0.5b,1.5b)")
    ap.add_argument("--modes", default="", help="modes that must have rows (e.g. full,lisa)")
    ap.add_argument("--require", default="shardswap,torch,deepspeed",
                    help="systems whose cells must have a timed run (default: all three)")
    args = ap.parse_args()
    require = split(args.require)
    bad = [s for s in require if s not in SYSTEMS]
    if bad:
        ap.error(f"--require: unknown system(s) {bad}; known: {','.join(SYSTEMS)}")

    bench = load_bench(args.bench)
    peer_rows = load_peers(args.peers)
    failures = []
    if bench is None and "shardswap" in require:
        failures.append(f"ShardSwap: {args.bench} is missing")
    bench = bench or {}
    peers = {}
    for r in peer_rows:
        if r.get("system") in ("torch", "deepspeed") and r.get("shape") and r.get("mode"):
            peers.setdefault((r["system"], shape_of(r), r["mode"]), []).append(r)
        elif r.get("status") != "ok":  # a failure before the script knew its shape
            failures.append(f"{r.get('system', '?')}: {r.get('error')}")

    keys = set(bench) | {(s, m) for _, s, m in peers}
    asked = {(s, m) for s in split(args.shapes) or SHAPE_ORDER for m in split(args.modes) or MODE_ORDER}
    keys |= {(s, m) for s in split(args.shapes) for m in split(args.modes)}
    shown = [s for s in SYSTEMS if s in require or (s == "shardswap" and bench)
             or any(k[0] == s for k in peers)]

    table = []
    for shape, mode in order(keys):
        b = bench.get((shape, mode))
        cells = {"shardswap": shardswap_cell(b)}
        for s in ("torch", "deepspeed"):
            cells[s] = peer_cell(peers.get((s, shape, mode)))
        micro = b.get("micro") if b else None
        if micro is None:
            micro = next((c[0]["first_micro"] for s, c in cells.items()
                          if s != "shardswap" and c[0] and c[0].get("first_micro")), None)
        row = {"shape": shape, "mode": mode, "micro": micro}
        for s in SYSTEMS:
            cell, why = cells[s]
            row[s] = cell
            # A cell that is there and failed counts always; an absent one where it was asked for.
            if why and (cell is not None or (s in require and (shape, mode) in asked)):
                failures.append(f"{shape} {mode} {NAMES[s]}: {why}")
            if s != "shardswap" and cell and cell.get("first_micro") not in (None, micro):
                row.setdefault("notes", []).append(
                    f"{NAMES[s]} started at micro-batch {cell['first_micro']}, not {micro}")
        row["shardswap_over_torch"] = ratio(row["shardswap"], row["torch"])
        row["shardswap_over_deepspeed"] = ratio(row["shardswap"], row["deepspeed"])
        table.append(row)

    lisa = {}
    for shape in dict.fromkeys(r["shape"] for r in table):
        by = {r["mode"]: r for r in table if r["shape"] == shape}
        if "full" in by and "lisa" in by:
            lisa[shape] = {s: ratio(by["lisa"][s], by["full"][s]) for s in shown}

    out = []
    p = out.append
    m = meta()
    p(f"decoder training side by side, seq 2048: {m['machine']}, driver {m['driver'] or '-'}, "
      f"{m['date']}, commit {m['commit']}" + (" (with uncommitted changes)"
                                               if m["uncommitted_changes"] else ""))
    p("tokens/s: median step; @N: the micro-batch a peer fitted at after halving (its ratio is at "
      "that batch); SS/PT, SS/DS: ShardSwap tokens/s over PyTorch's, DeepSpeed's; peak MiB: "
      "ShardSwap rank 0 peak, peers torch max_memory_allocated")
    p("")
    w = 15
    head = f"{'shape':>5} {'mode':>4} {'micro':>5}"
    for s in shown:
        head += f" {NAMES[s] + ' tok/s':>{w}}"
    for s in shown:
        if s != "shardswap" and "shardswap" in shown:
            head += f" {'SS/' + SHORT[s]:>6}"
    head += "  peak MiB: " + " / ".join(NAMES[s] for s in shown)
    p(head)
    for r in table:
        line = f"{r['shape']:>5} {r['mode']:>4} {fmt(r['micro'], 'd'):>5}"
        for s in shown:
            line += f" {fmt_tps(r[s], r['micro']):>{w}}"
        for s in shown:
            if s != "shardswap" and "shardswap" in shown:
                line += f" {fmt(r['shardswap_over_' + s], '.2f'):>6}"
        line += "  " + " / ".join(fmt((r[s] or {}).get("peak_mib"), ".0f") for s in shown)
        p(line)
        for note in r.get("notes", []):
            p(f"      note: {note}")
    if lisa:
        p("")
        p("LISA / full tokens/s: " + "; ".join(
            f"{shape}: " + ", ".join(f"{NAMES[s]} {fmt(v, '.2f')}" for s, v in by.items())
            for shape, by in lisa.items()))
    if failures:
        p("")
        p(f"{len(failures)} failed:")
        for f in failures:
            p("  " + f.replace("\n", " ")[:400])
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": m, "table": out, "rows": table, "lisa_over_full": lisa,
                       "failures": failures,
                       "inputs": {"bench": os.path.abspath(args.bench),
                                  "peers": os.path.abspath(args.peers)},
                       "shardswap_rows": list(bench.values()), "peer_rows": peer_rows},
                      f, indent=1)
            f.write("\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
