#!/usr/bin/env python3
"""Checks that the rooms of tools/ which must use the public API alone cannot reach the library's
internal headers: no source of theirs is compiled with the repo root (from which "engine/...",
"optimizer/..." and "memory/..." internal headers resolve) on its include path.

    usage: boundary_check.py COMPILE_COMMANDS_JSON REPO_ROOT

Reads the build's compile_commands.json (CMAKE_EXPORT_COMPILE_COMMANDS); exits 1 naming each
source compiled with the root on its path, or a room with no source in the build at all (a
check that found nothing to check must not pass)."""
import json
import os
import shlex
import sys

PUBLIC_ONLY_ROOMS = ["files", "model", "data", "trainer", "cli"]


def include_dirs(command, directory):
    args = shlex.split(command)
    dirs = []
    for i, a in enumerate(args):
        # Each flag takes its directory as the next argument or joined to it (-I/x,
        # -isystem/x, -iquote/x), as GCC, Clang and nvcc read them; -isystem and -iquote are
        # tried before -I, whose prefix they do not share.
        for flag in ("-isystem", "-iquote", "-I"):
            if a == flag and i + 1 < len(args):
                dirs.append(args[i + 1])
                break
            if a.startswith(flag) and len(a) > len(flag):
                dirs.append(a[len(flag):])
                break
    return [os.path.realpath(os.path.join(directory, d)) for d in dirs]


def main():
    commands_file, root = sys.argv[1], os.path.realpath(sys.argv[2])
    with open(commands_file, encoding="utf-8") as f:
        entries = json.load(f)
    seen = {room: 0 for room in PUBLIC_ONLY_ROOMS}
    bad = []
    for e in entries:
        source = os.path.realpath(os.path.join(e["directory"], e["file"]))
        rel = os.path.relpath(source, root)
        parts = rel.split(os.sep)
        if len(parts) < 3 or parts[0] != "tools" or parts[1] not in seen:
            continue
        seen[parts[1]] += 1
        command = e.get("command") or shlex.join(e["arguments"])
        if root in include_dirs(command, e["directory"]):
            bad.append(rel)
    for rel in sorted(set(bad)):
        print(f"{rel}: compiled with the repo root on its include path: the library's internal "
              f"headers are reachable (link ShardSwap::shardswap and shardswap_support, not "
              f"shardswap_internal)")
    for room, n in seen.items():
        if n == 0:
            print(f"tools/{room}: no source of this room in {commands_file}")
    if bad or 0 in seen.values():
        return 1
    print(f"boundary_check: {sum(seen.values())} sources in {', '.join(seen)} see the public API "
          f"and the support headers only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
