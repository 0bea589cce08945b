#!/usr/bin/env python3
"""Kill campaign: `shardswap train` killed at random moments and at chosen system calls of its
saves and prunes, then resumed with checkpoint.load=latest until it finishes. What must hold:

  * every metrics line any attempt writes equals the uninterrupted control run's line of the same
    step (loss, grad_norm, lr, loss scale, clip coefficient, validation loss, active set): every
    resume continues bit for bit;
  * the metrics file of a round, read as `shardswap plot` reads it (a resume marker supersedes
    the lines after its step), holds every step exactly once;
  * `latest` never goes backwards: an attempt resumes at or after the newest checkpoint an
    earlier attempt reported saved, and never starts from step 0 once one was saved;
  * every checkpoint left under the directory that lists as complete passes `ckpt inspect`;
  * the finished run's weights and fp32 masters (`ckpt export`, `--master`) equal the control's
    byte for byte.

First, the first attempt of each round runs under strace with a SIGKILL injected at the K-th call
of one system call (rename, fsync, unlink, unlinkat, rmdir, mkdir), for every K an uninterrupted
run makes, in two scenarios: a fresh run, and a second run of the same config over a finished
one's directory (its saves replace or sit beside the first run's, its prunes meet them). These
take up to 3/4 of the budget, in a shuffled order (a cut-short run still samples every call); the
summary says how many were tried. Then, for the rest of the budget (at least 3 rounds), attempts
are killed with SIGKILL after a random delay.

usage: kill_campaign.py SHARDSWAP [SECONDS] [--work DIR] [--seed N]
  SECONDS  time budget (default 180); the work folder defaults to a fresh one under /dev/shm
           (fsync there is cheap) or $TMPDIR. Exit 0 when every property held, 1 otherwise.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

STEPS, EVERY, KEEP = 16, 4, 2
CONFIG = {
    "world_size": 2, "steps": STEPS, "seed": 3,
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e4},
    "model": {"type": "decoder", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "tie_word_embeddings": True},
    "data": {"tokenizer": "bytes", "train": "/usr/share/common-licenses/GPL-3", "seq_len": 32},
    "layer_switching": {"type": "lisa", "interval": 6, "gamma": 1,
                        "layers": ["layers.0", "layers.1", "layers.2", "layers.3"],
                        "always_active": ["embed", "head"], "policy": "drop", "seed": 7},
    "logging": {"interval": 4, "eval_interval": 8, "eval_batches": 2},
}
COMPARED = ("loss", "grad_norm", "lr", "loss_scale", "clip_coef", "val_loss", "active_groups",
            "skipped")
SYSCALLS = ("rename", "fsync", "unlink", "unlinkat", "rmdir", "mkdir")


class Campaign:
    def __init__(self, binary, work, rng):
        self.binary, self.work, self.rng = binary, work, rng
        self.config = os.path.join(work, "config.json")
        with open(self.config, "w") as f:
            json.dump(CONFIG, f)
        self.failures = []
        self.counts = {"rounds": 0, "attempts": 0, "random kills": 0, "kills with a save in flight": 0,
                       "injected kills": 0, "injections that never fired": 0}

    def fail(self, what):
        self.failures.append(what)
        print(f"FAIL: {what}", flush=True)

    def command(self, ckdir, metrics, load_latest=True):
        cmd = [self.binary, "train", "--config", self.config, "--metrics", metrics,
               "--set", f"checkpoint.dir={ckdir}", "--set", f"checkpoint.every={EVERY}",
               "--set", f"checkpoint.keep={KEEP}"]
        if load_latest:
            cmd += ["--set", "checkpoint.load=latest"]
        return cmd

    # ---- the control run ----

    def control(self):
        ckdir, metrics = os.path.join(self.work, "control"), os.path.join(self.work, "control.jsonl")
        r = subprocess.run(self.command(ckdir, metrics, load_latest=False), capture_output=True,
                           text=True)
        if r.returncode != 0:
            sys.exit(f"kill_campaign: the control run failed:\n{r.stdout}{r.stderr}")
        self.expected = {}
        for m in read_lines(metrics):
            if "step" in m:
                self.expected[m["step"]] = {k: m.get(k) for k in COMPARED}
        if sorted(self.expected) != list(range(1, STEPS + 1)):
            sys.exit(f"kill_campaign: the control's metrics hold steps {sorted(self.expected)}")
        self.final = self.exports(self.newest_of_step(ckdir, STEPS), "control")

    def exports(self, ckpt, tag):
        out = {}
        for kind, extra in (("bit16", []), ("master", ["--master"])):
            path = os.path.join(self.work, f"{tag}-{kind}.safetensors")
            r = subprocess.run([self.binary, "ckpt", "export", ckpt, "--out", path] + extra,
                               capture_output=True, text=True)
            if r.returncode != 0:
                self.fail(f"ckpt export {ckpt} {' '.join(extra)}: {r.stderr.strip()}")
                return None
            with open(path, "rb") as f:
                out[kind] = f.read()
            os.remove(path)
        return out

    @staticmethod
    def complete_checkpoints(ckdir):
        """Directories that list as checkpoints: step-N (or step-N-SUFFIX) with a metadata file."""
        out = []
        for name in sorted(os.listdir(ckdir)) if os.path.isdir(ckdir) else []:
            if name.startswith("step-") and "." not in name and \
                    os.path.exists(os.path.join(ckdir, name, "metadata.json")):
                out.append(os.path.join(ckdir, name))
        return out

    def newest_of_step(self, ckdir, step):
        found = [c for c in self.complete_checkpoints(ckdir)
                 if os.path.basename(c).startswith(f"step-{step:08d}")]
        if not found:
            self.fail(f"no checkpoint of step {step} under {ckdir}: {os.listdir(ckdir)}")
            return None
        return max(found, key=lambda c: os.stat(os.path.join(c, "metadata.json")).st_mtime_ns)

    # ---- one round: attempts until one finishes ----

    def round(self, label, ckdir, metrics, killer, first_fresh=False):
        """Runs attempts (the first without load=latest when first_fresh) until one exits by
        itself; `killer(attempt, popen_args)` runs one attempt and returns (returncode, killed,
        stdout). Checks every attempt's lines and the resume points."""
        self.counts["rounds"] += 1
        floor, attempt = 0, 0  # floor: the newest step an earlier attempt reported saved
        written = set()  # names of the checkpoints this round's attempts reported saved
        finished_at = 0  # an attempt resumed a finished run's checkpoint: nothing was written
        while True:
            attempt += 1
            self.counts["attempts"] += 1
            if attempt > 200:
                self.fail(f"{label}: no attempt finished in 200")
                return
            cmd = self.command(ckdir, metrics, load_latest=not (first_fresh and attempt == 1))
            rc, killed, out = killer(attempt, cmd)
            where = f"{label}, attempt {attempt}"
            resumed, saved = None, 0
            for line in out.splitlines():
                if "resumed from" in line and ": step " in line:
                    resumed = int(line.split(": step ")[1].split(",")[0])
                if "no checkpoint under" in line and "starting at step 0" in line:
                    resumed = 0
                if line.startswith("already finished: the checkpoint resumed is at step "):
                    finished_at = max(finished_at, int(line.split(" at step ")[1].split()[0]))
                if "checkpoint saved:" in line:
                    saved = max(saved, int(line.rsplit("step-", 1)[1][:8]))
                    written.add(os.path.basename(line.split("checkpoint saved:")[1].strip()))
            if resumed is not None and resumed < floor:
                self.fail(f"{where}: resumed at step {resumed}, an earlier attempt had saved "
                          f"step {floor}")
            floor = max(floor, saved)
            for c in self.complete_checkpoints(ckdir):
                r = subprocess.run([self.binary, "ckpt", "inspect", c], capture_output=True,
                                   text=True)
                if r.returncode != 0:
                    self.fail(f"{where}: '{c}' lists as complete but inspect refuses it: "
                              f"{r.stderr.strip()}")
            if not killed:
                if rc != 0:
                    self.fail(f"{where}: exit {rc} without a kill:\n{out[-2000:]}")
                    return
                break
        self.check_metrics(label, metrics, written, finished_at)
        final = self.newest_of_step(ckdir, STEPS)
        if final and self.final:
            got = self.exports(final, "round")
            if got and got != self.final:
                self.fail(f"{label}: the finished run's {final} differs from the control's")

    def check_metrics(self, label, metrics, written, finished_at=0):
        """Every step once, after superseding; the steps up to a resume from a checkpoint this
        round did not write (the finished first run's, in the second-run scenario) were never
        this file's to hold. Resuming a finished run writes nothing (not even a resume line):
        `finished_at` is the step of such a checkpoint, exempt as well unless this round wrote
        it."""
        lines = read_lines(metrics, label=label, fail=self.fail) if os.path.exists(metrics) else []
        kept = {}
        exempt_upto = finished_at if f"step-{finished_at:08d}" not in written else 0
        for m in lines:
            if "resumed" in m:
                at = m["resumed"].get("step", 0)
                kept = {s: v for s, v in kept.items() if s <= at}
                if os.path.basename(str(m["resumed"].get("checkpoint", ""))) not in written:
                    exempt_upto = max(exempt_upto, at)
                continue
            if "step" not in m:
                continue
            s = m["step"]
            values = {k: m.get(k) for k in COMPARED}
            if values != self.expected.get(s):
                self.fail(f"{label}: metrics of step {s} differ from the control's: {values} "
                          f"against {self.expected.get(s)}")
            if s in kept:
                self.fail(f"{label}: step {s} twice in the metrics without a resume between")
            kept[s] = values
        missing = [s for s in range(exempt_upto + 1, STEPS + 1) if s not in kept]
        if missing:
            self.fail(f"{label}: the metrics file lacks steps {missing}")

    # ---- killers ----

    def random_killer(self, ckdir):
        def run(attempt, cmd):
            # Delays up to the control's duration, so that kills fall everywhere in the run.
            delay = self.rng.uniform(0.0, self.control_seconds * 1.1)
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                out, _ = p.communicate(timeout=delay)
                return p.returncode, False, out
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                out, _ = p.communicate()
                self.counts["random kills"] += 1
                if os.path.isdir(ckdir) and any(n.endswith(".tmp-save") for n in os.listdir(ckdir)):
                    self.counts["kills with a save in flight"] += 1
                return p.returncode, True, out
        return run

    def injecting_killer(self, syscall, when):
        def run(attempt, cmd):
            if attempt == 1:
                cmd = ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}",
                       "-e", f"inject={syscall}:signal=KILL:when={when}"] + cmd
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            killed = attempt == 1 and r.returncode == -signal.SIGKILL
            if attempt == 1:
                self.counts["injected kills" if killed else "injections that never fired"] += 1
            return r.returncode, killed, r.stdout
        return run

    def syscall_counts(self, ckdir):
        """How often an uninterrupted run with a fresh start in `ckdir` calls each system call
        (strace -c)."""
        counts = {}
        summary = os.path.join(self.work, "strace-c.txt")
        cmd = ["strace", "-f", "-qq", "-c", "-o", summary,
               "-e", "trace=" + ",".join(SYSCALLS)] + \
            self.command(ckdir, os.path.join(self.work, "count.jsonl"), load_latest=False)
        subprocess.run(cmd, capture_output=True, check=True)
        for line in open(summary):
            parts = line.split()
            if parts and parts[-1] in SYSCALLS:
                counts[parts[-1]] = int(parts[3])
        return counts


def read_lines(path, label="", fail=None):
    out = []
    if not os.path.exists(path):
        if fail:
            fail(f"{label}: no metrics file")
        return out
    with open(path, "rb") as f:
        data = f.read()
    for i, raw in enumerate(data.split(b"\n")):
        if not raw:
            continue
        try:
            out.append(json.loads(raw))
        except ValueError:
            if fail:
                fail(f"{label}: metrics line {i + 1} is not JSON: {raw[:80]!r}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary")
    ap.add_argument("seconds", nargs="?", type=float, default=180.0)
    ap.add_argument("--work")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if shutil.which("strace") is None:
        sys.exit("kill_campaign: needs strace (Debian package strace)")
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    work = args.work or tempfile.mkdtemp(prefix="kill-campaign-", dir=base)
    os.makedirs(work, exist_ok=True)
    rng = random.Random(args.seed)
    c = Campaign(os.path.abspath(args.binary), work, rng)
    started = time.monotonic()
    c.control()
    c.control_seconds = time.monotonic() - started
    deadline = started + args.seconds
    print(f"kill_campaign: control run {c.control_seconds:.2f} s; budget {args.seconds:.0f} s; "
          f"work folder {work}", flush=True)

    # Kills injected at every call of each system call, in two scenarios.
    phase2_end = started + 0.75 * args.seconds  # the rest is for random kills
    plan = []
    counting = os.path.join(work, "counting")
    fresh = c.syscall_counts(counting)
    for name, count in sorted(fresh.items()):
        plan += [("fresh", name, k) for k in range(1, count + 1)]
    second = c.syscall_counts(counting)  # over the finished first run: the second-run scenario
    for name, count in sorted(second.items()):
        plan += [("second run", name, k) for k in range(1, count + 1)]
    rng.shuffle(plan)  # a bounded run then samples every system call and scenario
    done = 0
    finished = os.path.join(work, "finished")
    shutil.rmtree(finished, ignore_errors=True)
    subprocess.run(c.command(finished, os.path.join(work, "finished.jsonl"), load_latest=False),
                   capture_output=True, check=True)
    for scenario, name, k in plan:
        if time.monotonic() >= phase2_end:
            break
        ckdir, metrics = os.path.join(work, "inject"), os.path.join(work, "inject.jsonl")
        shutil.rmtree(ckdir, ignore_errors=True)
        if os.path.exists(metrics):
            os.remove(metrics)
        if scenario == "second run":
            shutil.copytree(finished, ckdir)
        c.round(f"{scenario}, kill at {name} #{k}", ckdir, metrics, c.injecting_killer(name, k),
                first_fresh=True)
        done += 1

    # Random kills for the rest of the budget (at least 3 rounds).
    n = 0
    while time.monotonic() < deadline or n < 3:
        n += 1
        ckdir, metrics = os.path.join(work, f"random-{n}"), os.path.join(work, f"random-{n}.jsonl")
        c.round(f"random round {n}", ckdir, metrics, c.random_killer(ckdir))
        shutil.rmtree(ckdir, ignore_errors=True)

    print(f"kill_campaign: {time.monotonic() - started:.0f} s; " +
          ", ".join(f"{v} {k}" for k, v in c.counts.items()) +
          f"; injection points {done} of {len(plan)} (" +
          ", ".join(f"{k} {v}" for k, v in sorted(fresh.items())) + " per fresh run, " +
          ", ".join(f"{k} {v}" for k, v in sorted(second.items())) + " per second run)")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    if c.failures:
        print(f"kill_campaign: {len(c.failures)} failure(s)")
        sys.exit(1)
    print("kill_campaign: every property held")


if __name__ == "__main__":
    main()
