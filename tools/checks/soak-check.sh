#!/usr/bin/env bash
# Memory soak through `shardswap train`: runs a config (configs/soak.json: 10,000 steps, a LISA
# switch every 10) and checks from its metrics that nothing leaks over the run:
#  - device: the driver's free memory (metrics' device_free_bytes, cuda backend only, sampled
#    every logging.interval steps) at the last sample is not more than TOLERANCE below the first;
#  - engine: rank 0's requested bytes (memory_bytes.total) are the same every time the same
#    active set comes back (from the step where every group of the run has been active once:
#    keep_device may grow until then); and so are the engine's host bytes
#    (host_memory_bytes.total), where it holds any (state on the host, or kept there);
#  - plan: every "predicted ... measured peak" line of the log (after step 1 and each switch), the
#    device's and the host's, within 2%.
# On the cpu backend there is no device figure: engine and plan only, and it says so.
#   usage: soak-check.sh CONFIG [--set k=v]... [--tolerance-mib N] [--bin SHARDSWAP] [--out DIR]
#          soak-check.sh --metrics FILE [--tolerance-mib N]      (checks a metrics file only)
# SHARDSWAP defaults to build/cuda/tools/shardswap (preset cuda). --out keeps the metrics and the
# log there. Exit 0: all checks pass; 1: a check failed or the run failed; 2: bad usage or input.
set -euo pipefail
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # as tools/checks/gpu-check.sh, with communicator nccl
usage() { sed -n '/^#   usage/,/^#   *soak-check.sh --metrics/p' "$0" | sed 's/^# *//' >&2; exit 2; }

config="" metrics="" tolerance=16 bin=$(dirname "$0")/../../build/cuda/tools/shardswap out=""
sets=()
while [ $# -gt 0 ]; do
  case $1 in
    --set) [ $# -ge 2 ] || usage; sets+=(--set "$2"); shift 2 ;;
    --metrics) [ $# -ge 2 ] || usage; metrics=$2; shift 2 ;;
    --tolerance-mib) [ $# -ge 2 ] || usage; tolerance=$2; shift 2 ;;
    --bin) [ $# -ge 2 ] || usage; bin=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || usage; out=$2; shift 2 ;;
    -*) echo "soak-check: unknown option '$1'" >&2; usage ;;
    *) [ -z "$config" ] || usage; config=$1; shift ;;
  esac
done
case $tolerance in
  '' | *[!0-9.]* | *.*.*) echo "soak-check: --tolerance-mib '$tolerance': expected a number of MiB" >&2; exit 2 ;;
esac
if [ -n "$metrics" ]; then
  [ -z "$config" ] && [ ${#sets[@]} -eq 0 ] || { echo "soak-check: --metrics takes no CONFIG or --set" >&2; exit 2; }
  [ -r "$metrics" ] || { echo "soak-check: --metrics '$metrics': cannot read the file" >&2; exit 2; }
  log=""
else
  [ -n "$config" ] || usage
  [ -x "$bin" ] || { echo "soak-check: no shardswap at '$bin' (build it, e.g. cmake --preset cuda && cmake --build --preset cuda --target shardswap_cli, or pass --bin)" >&2; exit 2; }
  if [ -n "$out" ]; then
    mkdir -p "$out"
    work=$out
  else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
  fi
  metrics=$work/soak-metrics.jsonl log=$work/soak-train.log
  echo "soak-check: $bin train --config $config ${sets[*]}"
  started=$(date +%s)
  rc=0
  "$bin" train --config "$config" "${sets[@]}" --metrics "$metrics" > "$log" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    tail -20 "$log"
    echo "soak-check: shardswap train exited $rc"
    [ $rc -eq 2 ] && exit 2 || exit 1
  fi
  grep -E "^done:" "$log" || true
  echo "soak-check: the run took $(($(date +%s) - started)) s"
fi

export PYTHONUNBUFFERED=1
python3 - "$metrics" "$log" "$tolerance" <<'PY'
import json, re, sys

metrics_path, log_path, tolerance_mib = sys.argv[1], sys.argv[2], float(sys.argv[3])
MiB = 1048576.0

def mib(b):
    return f"{b / MiB:,.2f}"

def bad_input(message):
    print(f"soak-check: {metrics_path}: {message}")
    sys.exit(2)

lines = []
with open(metrics_path) as f:
    for number, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            m = json.loads(text)
            m["step"], m["memory_bytes"]["total"], m["active_groups"]
        except (ValueError, KeyError, TypeError) as e:
            bad_input(f"line {number}: not a metrics line with step, memory_bytes.total and "
                      f"active_groups ({e.__class__.__name__}: {e})")
        lines.append(m)
if not lines:
    bad_input("no metrics lines")
steps = [m["step"] for m in lines]
if steps != list(range(steps[0], steps[0] + len(steps))):
    gap = next(a for a, b in zip(steps, steps[1:]) if b != a + 1)
    bad_input(f"steps are not consecutive (after step {gap})")

failures = []
switches = sum(1 for m in lines if "switch" in m)
if switches == 0:
    failures.append("no layer switch in the run: nothing was soaked")

# Engine: requested bytes as a function of the active set. Before every group of the run has
# been active once, keep_device may legitimately grow (it keeps the state of each group it
# leaves on the device), so the references are taken from that point on.
every_group = set().union(*(m["active_groups"] for m in lines))
seen, settled = set(), len(lines)
for i, m in enumerate(lines):
    seen.update(m["active_groups"])
    if seen == every_group:
        settled = i
        break
def same_bytes_per_set(name, field):
    """Requested bytes of `field` (the device's memory_bytes, the host's host_memory_bytes) as a
    function of the active set, from `settled` on: (sets, revisits compared)."""
    reference, mismatches, revisits, stretch, previous = {}, [], 0, 0, None
    for m in lines[settled:]:
        key = tuple(sorted(m["active_groups"]))
        total = m.get(field, {}).get("total", 0)
        if key != previous:
            stretch += 1
            if key in reference:
                revisits += 1
        reference.setdefault(key, (m["step"], total))
        if total != reference[key][1]:
            mismatches.append((stretch, m["step"], key, total, *reference[key]))
        previous = key
    if switches and not revisits:
        failures.append(f"{name}: no active set came back after a switch once every group had "
                        "been active: nothing to compare (run more steps)")
    if mismatches:
        stretches = sorted({x[0] for x in mismatches})
        failures.append(f"{name}: requested bytes differ from the first time the same set was "
                        f"active at {len(mismatches)} steps, in {len(stretches)} stretches "
                        "between switches")
        for s in stretches[:3]:
            _, step, key, total, first_step, first_total = next(x for x in mismatches if x[0] == s)
            failures.append(f"{name}: after step {step} active [{', '.join(key)}]: {total:,} "
                            f"bytes, {total - first_total:+,} against step {first_step}")
    return len(reference), revisits

sets_seen, revisits = same_bytes_per_set("engine", "memory_bytes")
# The engine's host memory (state placed on the host, or kept there), where it holds any.
has_host = any("host_memory_bytes" in m for m in lines)
if has_host:
    same_bytes_per_set("host", "host_memory_bytes")

# Device: the driver's free memory, first sample against last.
samples = [(m["step"], m["device_free_bytes"]) for m in lines if "device_free_bytes" in m]
if len(samples) == 1:
    failures.append("device: one free-memory sample only: no curve (run more than "
                    "logging.interval steps)")
drift = None
if len(samples) >= 2:
    drift = samples[-1][1] - samples[0][1]
    if -drift > tolerance_mib * MiB:
        low = min(samples, key=lambda s: s[1])
        failures.append(f"device: free memory fell {-drift / MiB:.2f} MiB from step "
                        f"{samples[0][0]} to step {samples[-1][0]} (tolerance "
                        f"{tolerance_mib:g} MiB; lowest {mib(low[1])} MiB at step {low[0]})")

# Plan: the log's predicted-against-measured lines (after step 1 and after each switch).
plan = []
if log_path:
    pattern = re.compile(r"memory of rank 0 after step (\d+): predicted .*\(([-+]?[\d.]+)%\)")
    with open(log_path) as f:
        plan = [(int(p.group(1)), float(p.group(2))) for p in map(pattern.search, f) if p]
    off = [(s, d) for s, d in plan if abs(d) > 2.0]
    for s, d in off[:3]:
        failures.append(f"plan: the measured peak after step {s} is {d:+.3f}% off the plan")
    if not plan:
        failures.append("plan: the log has no 'memory of rank 0 after step' line")

rows = [("steps", f"{steps[0]}..{steps[-1]} ({len(steps)})"),
        ("switches", f"{switches}"),
        ("engine total, first / last step (bytes)",
         f"{lines[0]['memory_bytes']['total']:,} / {lines[-1]['memory_bytes']['total']:,}"),
        ("engine: active sets / revisits compared",
         f"{sets_seen} / {revisits} (from step {lines[settled]['step']})"
         if settled < len(lines) else "none")]
if has_host:
    rows.append(("host total, first / last step (bytes)",
                 f"{lines[0].get('host_memory_bytes', {}).get('total', 0):,} / "
                 f"{lines[-1].get('host_memory_bytes', {}).get('total', 0):,}"))
if samples:
    frees = [b for _, b in samples]
    total = next(m["device_total_bytes"] for m in lines if "device_free_bytes" in m)
    rows += [("device free samples", f"{len(samples)} (steps {samples[0][0]}..{samples[-1][0]})"),
             ("device free first / last (MiB)", f"{mib(frees[0])} / {mib(frees[-1])} of {mib(total)}"),
             ("device free min / max (MiB)", f"{mib(min(frees))} / {mib(max(frees))}")]
    if drift is not None:
        rows.append(("device free drift last - first (MiB)", f"{drift / MiB:+,.2f} "
                     f"(tolerance -{tolerance_mib:g})"))
if plan:
    worst = max(plan, key=lambda p: abs(p[1]))
    rows.append(("plan checks / worst (%)", f"{len(plan)} / {worst[1]:+.3f} after step {worst[0]}"))
width = max(len(name) for name, _ in rows)
for name, value in rows:
    print(f"  {name:<{width}}  {value}")
if not samples:
    print("soak-check: no device_free_bytes in the metrics (cpu backend): engine totals" +
          (", host totals" if has_host else "") + (" and the plan" if log_path else "") +
          " checked only")
if not log_path:
    print("soak-check: metrics file only: the plan against the measured peak is not checked")
for failure in failures:
    print(f"soak-check: FAIL {failure}")
print("soak-check: " + ("FAILED" if failures else "passed"))
sys.exit(1 if failures else 0)
PY
