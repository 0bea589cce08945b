#!/usr/bin/env python3
"""Test names that CTest can run: catch_discover_tests registers each Catch test case under its
name, and CTest splits a name at ';' (its list separator), so such a test is registered as two
that match nothing and fail. This check reads every TEST_CASE name (adjacent string literals
joined) under the given folders and exits 1 naming each one holding ';'. It first checks itself
on a made-up source (a bad name must be found, a good one not), so that a change to the pattern
cannot make it pass by reading nothing.

usage: test_names_check.py DIR...
"""
import pathlib
import re
import sys

# TEST_CASE( then one or more string literals, possibly on several lines.
CASE = re.compile(r'TEST_CASE\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)')
LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')


def names(text):
    return ["".join(LITERAL.findall(m.group(1))) for m in CASE.finditer(text)]


def bad(text):
    return [n for n in names(text) if ";" in n]


def main(dirs):
    sample = 'TEST_CASE("a good name, with a comma") {}\nTEST_CASE("a bad one; "\n  "split") {}\n'
    if bad(sample) != ["a bad one; split"] or len(names(sample)) != 2:
        print("test_names_check: the pattern no longer reads TEST_CASE names", file=sys.stderr)
        return 1
    count, failures = 0, []
    for d in dirs:
        for path in sorted(pathlib.Path(d).rglob("*.cpp")):
            text = path.read_text(encoding="utf-8", errors="replace")
            count += len(names(text))
            failures += [f"{path}: {n}" for n in bad(text)]
    for f in failures:
        print(f"test name holds ';' (CTest splits it there): {f}", file=sys.stderr)
    if count == 0:
        print("test_names_check: no TEST_CASE found", file=sys.stderr)
        return 1
    print(f"test_names_check: {count} test names read, {len(failures)} with ';'")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
