#!/usr/bin/env bash
# Keeps a doc page and example programs the same text (docs/api.md and tools/examples/*.cpp;
# CTest runs it):
#  - every code block in DOC preceded by a line `<!-- snippet: NAME -->` must equal, line for line,
#    the lines of the one SOURCE holding `// doc-snippet: NAME`, up to `// doc-snippet-end` (the
#    region's common indentation removed);
#  - the text block after `<!-- output: NAME -->`, NAME being PROGRAM's file name, must equal
#    what PROGRAM prints on stdout.
# It fails if DOC has no snippet at all, so a renamed marker cannot make it pass by checking nothing.
#   usage: tools/checks/docs-check.sh DOC PROGRAM SOURCE...
set -euo pipefail
doc=$1 program=$2
shift 2
sources=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0

# The block that follows the marker line `<!-- KIND: NAME -->` in the doc, fences removed.
doc_block() {
  awk -v marker="<!-- $1: $2 -->" '
    $0 == marker { armed = 1; next }
    armed && /^```/ { if (inside) exit; inside = 1; next }
    inside { print }' "$doc"
}

# The lines inside the named region of the source holding it, common leading spaces removed.
source_region() {
  local file
  file=$(grep -l -- "// doc-snippet: $1\$" "${sources[@]}" | head -1) || true
  [ -n "$file" ] || return 0
  awk -v name="$1" '
    $0 ~ "// doc-snippet: " name "$" { inside = 1; next }
    inside && /\/\/ doc-snippet-end/ { exit }
    inside { lines[n++] = $0 }
    END {
      strip = -1
      for (i = 0; i < n; i++) {
        if (lines[i] ~ /^ *$/) continue
        match(lines[i], /^ */)
        if (strip < 0 || RLENGTH < strip) strip = RLENGTH
      }
      if (strip < 0) strip = 0
      for (i = 0; i < n; i++) print substr(lines[i], strip + 1)
    }' "$file"
}

names=$(sed -n 's/^<!-- snippet: \(.*\) -->$/\1/p' "$doc")
if [ -z "$names" ]; then
  echo "docs-check: $doc has no <!-- snippet: NAME --> block"
  exit 1
fi
count=0
for name in $names; do
  count=$((count + 1))
  doc_block snippet "$name" > "$tmp/doc"
  source_region "$name" > "$tmp/source"
  if [ ! -s "$tmp/source" ]; then
    echo "docs-check: no region '// doc-snippet: $name' in ${sources[*]}"
    status=1
  elif ! diff -u --label "source ($name)" --label "$doc ($name)" "$tmp/source" "$tmp/doc"; then
    status=1
  fi
done

label=$(basename "$program")
doc_block output "$label" > "$tmp/doc-output"
if [ ! -s "$tmp/doc-output" ]; then
  echo "docs-check: $doc has no <!-- output: $label --> block"
  status=1
else
  "$program" > "$tmp/output"
  if ! diff -u --label "$label prints" --label "$doc shows" "$tmp/output" "$tmp/doc-output"; then
    status=1
  fi
fi
[ "$status" -eq 0 ] && echo "docs-check: $count snippets of $doc match ${sources[*]}; its output block matches $label"
exit "$status"
