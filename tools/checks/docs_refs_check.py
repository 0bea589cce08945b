#!/usr/bin/env python3
"""Checks that what the project's Markdown pages name exists (CTest runs it), so a renamed file,
a removed test or a renamed function cannot leave a page pointing at nothing:

- every path into the tree (tests/..., tools/..., engine/..., memory/..., optimizer/...,
  partition/..., configs/..., docs/..., cmake/...) names a tracked file or folder;
- every identifier in backticks that is qualified (`Engine::plan()`), CamelCase with two humps or
  more (`StaleView`) or snake_case (`run_ranks`) occurs in the code (sources, scripts, CMake);
- every invariant of docs/architecture.md names the tests that hold it (a path under tests/ or
  tools/).

Not checked: a path written with a placeholder or a pattern (`configs/qwen2.5-SHAPE.json`,
`tests/fuzz/corpus/<target>/`, `tools/process_launch.{h,cpp}`, `*`), a path the same line says
was removed, and the paths of other projects listed in OTHER_PROJECTS.

  usage: tools/checks/docs_refs_check.py [REPO_ROOT]      exit 0: all found; 1: each miss listed
"""
import os
import re
import sys

# Paths of other projects that the pages quote, and whose they are.
OTHER_PROJECTS = {
    "tests/deepspeed/ds_config_zero2.json": "transformers",
}

TREE_PATH = re.compile(
    r"(?<![\w/.\-])((?:tests|tools|engine|memory|optimizer|partition|configs|docs|cmake|\.ci)/"
    r"[A-Za-z0-9_./\-]*[A-Za-z0-9_/])")
QUALIFIED = re.compile(r"`([A-Za-z_]\w*(?:::~?[A-Za-z_]\w*)+)(?:\([^`]*\))?`")
SINGLE = re.compile(r"`([A-Z][a-z0-9]+[A-Z]\w*|[a-z][a-z0-9]*_[a-z0-9_]+)(?:\([^`]*\))?`")
PLACEHOLDER = re.compile(r"[*<>{}\[\]$]|[A-Z]{3,}")


def tree_files(root):
    """The tree's files, relative to `root`: every file outside build/ and hidden folders (.git,
    the peers' unpacked sources) but .ci/. Not git's list: a copy of the tree may carry no .git,
    or a stale one."""
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders
                         if (d == ".ci" or not d.startswith(".")) and
                         not (folder == root and d == "build")]
        files += [os.path.relpath(os.path.join(folder, n), root) for n in names]
    return files


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    files = tree_files(root)
    tracked = set(files)
    folders = {os.path.dirname(f) for f in files}
    for f in list(folders):
        while f:
            f = os.path.dirname(f)
            folders.add(f)
    words = set()
    for f in files:
        if f.endswith((".h", ".cpp", ".cu", ".cuh", ".py", ".sh", ".txt", ".cmake", ".json",
                       ".in")):
            with open(os.path.join(root, f), errors="replace") as src:
                words.update(re.findall(r"[A-Za-z_]\w*", src.read()))
        words.add(os.path.splitext(os.path.basename(f))[0])

    misses = []
    for doc in (f for f in files if f.endswith(".md")):
        with open(os.path.join(root, doc), errors="replace") as page:
            lines = page.read().split("\n")
        for number, line in enumerate(lines, 1):
            where = f"{doc}:{number}"
            for m in TREE_PATH.finditer(line):
                path = m.group(1)
                rest = re.match(r"[^\s`),;]*", line[m.end():]).group(0)
                if PLACEHOLDER.search(path + rest) or path in OTHER_PROJECTS:
                    continue
                if "removed" in line[m.end():m.end() + 40]:
                    continue
                if path.rstrip("/") not in tracked and path.rstrip("/") not in folders:
                    misses.append(f"{where}: the path {path} is not in the tree")
            for m in QUALIFIED.finditer(line):
                parts = [p.lstrip("~") for p in m.group(1).split("::") if p != "std"]
                if parts and m.group(1).split("::")[0] != "std":
                    missing = [p for p in parts if p not in words]
                    if missing:
                        misses.append(f"{where}: `{m.group(1)}`: {', '.join(missing)} not in the code")
            for m in SINGLE.finditer(line):
                if m.group(1) not in words:
                    misses.append(f"{where}: `{m.group(1)}` is not in the code")

    # Every invariant names its tests.
    arch = os.path.join(root, "docs/architecture.md")
    with open(arch) as page:
        text = page.read()
    section = text.split("## Invariants", 1)[1].split("\n## ", 1)[0]
    for item in re.split(r"\n(?=\d+\. )", section.strip()):
        if re.match(r"\d+\. ", item) and not re.search(r"(?:tests|tools)/", item):
            misses.append(f"docs/architecture.md: invariant '{item[:60]}...' names no test")

    for miss in misses:
        print(miss)
    print(f"docs_refs_check: {len(misses)} name(s) not found")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
