#!/bin/sh
# tools/checks/docs_refs_check.py over the tree passes, and over a small repository whose page names a
# file, a function and an invariant's test that do not exist it fails naming each.
# Usage: docs_refs.sh REPO_ROOT
set -eu
root=$1
python3 "$root/tools/checks/docs_refs_check.py" "$root"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/docs" "$work/engine" "$work/tests"
printf 'void run_ranks();\n' > "$work/engine/comm.h"
printf '// a test\n' > "$work/tests/comm_test.cpp"
cat > "$work/docs/architecture.md" <<'PAGE'
# Architecture
## Invariants
1. **Held.** Checked (tests/comm_test.cpp).
2. **Not held.** Said, never checked.
## Next
PAGE
cat > "$work/docs/api.md" <<'PAGE'
`run_ranks` is in engine/comm.h; `Engine::plan()` in engine/engine.h; `missing_call` too.
PAGE
if out=$(python3 "$root/tools/checks/docs_refs_check.py" "$work"); then
  echo "docs_refs.sh: the check passed a page naming what does not exist"; exit 1
fi
echo "$out"
for expect in "the path engine/engine.h is not in the tree" "\`Engine::plan\`: Engine, plan not in the code" \
    "\`missing_call\` is not in the code" "invariant '2. **Not held.**" "4 name(s) not found"; do
  case $out in
    *"$expect"*) ;;
    *) echo "docs_refs.sh: expected '$expect'"; exit 1 ;;
  esac
done
echo "docs_refs.sh: PASS"
