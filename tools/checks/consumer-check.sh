#!/usr/bin/env bash
# Checks ShardSwap the way other projects consume it (docs/api.md, "Use ShardSwap from your CMake
# project"), from an already built tree (default build/default; tools/test.sh runs it after the
# default suite):
#  1. installed package: `cmake --install` into a temporary prefix; tools/examples configured
#     as a project of its own with find_package(ShardSwap), built and run (exit 0);
#  2. the installed include tree holds the public headers only (include/shardswap/*.h), and a
#     file including only <shardswap/engine.h> compiles with -I<prefix>/include alone: no Eigen,
#     no internal header (prints its preprocessed line count);
#  3. pkg-config: shardswap.pc gives the flags, and custom_trainer.cpp builds and runs with them;
#  4. add_subdirectory: tests/consumer/add_subdirectory builds ShardSwap (CPU, SHARDSWAP_CUDA=OFF,
#     library only) inside its own build and custom_trainer.cpp against it, then runs it.
# A sanitized build (SHARDSWAP_SANITIZE=ON, preset asan; tools/test.sh checks build/asan too):
# 1 and 3 build the consumers with nothing but what the package and shardswap.pc hand them, so
# they link only if the -fsanitize flags are handed over (checked by name as well); 4 is skipped
# (it builds a library of its own, not this one).
# Usage: bash tools/checks/consumer-check.sh [build dir]
set -euo pipefail
cd "$(dirname "$0")/../.."
root="$PWD"
build="${1:-build/default}"
jobs="$(nproc)"
[ -f "$build/CMakeCache.txt" ] || { echo "consumer-check: no build in '$build' (cmake --preset default && cmake --build --preset default)" >&2; exit 2; }
bash tools/install-deps.sh  # pkg-config among them (dpkg-checked, installs only what is missing)
sanitized=0
grep -q '^SHARDSWAP_SANITIZE:BOOL=ON$' "$build/CMakeCache.txt" && sanitized=1
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"
say() { echo "consumer-check: $*"; }
fail() { echo "consumer-check: FAIL $*" >&2; exit 1; }

# 1. The installed package, from a project that knows nothing of the source tree.
start=$SECONDS
cmake --install "$build" --prefix "$prefix" > "$tmp/install.log"
cmake -S tools/examples -B "$tmp/examples" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  > "$tmp/examples-configure.log" || { cat "$tmp/examples-configure.log"; fail "configuring tools/examples against the installed package"; }
grep 'ShardSwap .* from ' "$tmp/examples-configure.log" | sed 's/^-- /consumer-check: /'
cmake --build "$tmp/examples" -j "$jobs" > "$tmp/examples-build.log" \
  || { cat "$tmp/examples-build.log"; fail "building tools/examples against the installed package"; }
rc=0; "$tmp/examples/shardswap_example_custom_trainer" > "$tmp/examples-run.log" 2>&1 || rc=$?
[ $rc -eq 0 ] || { cat "$tmp/examples-run.log"; fail "the installed-package example exited $rc"; }
say "installed package: tools/examples built and ran, exit 0 ($((SECONDS - start)) s)"

# 2. Public headers only, and they stand on their own.
extra="$(cd "$prefix/include" && find . -mindepth 1 ! -path './shardswap' ! -path './shardswap/*.h')"
[ -z "$extra" ] || fail "installed include tree holds more than shardswap/*.h: $extra"
installed="$(cd "$prefix/include/shardswap" && ls)"
expected="$(ls memory/include/shardswap optimizer/include/shardswap partition/include/shardswap \
            engine/include/shardswap | grep '\.h$' | sort)"
[ "$installed" = "$expected" ] || fail "installed headers differ from the modules' include/shardswap"
printf '#include <shardswap/engine.h>\nint main() { return 0; }\n' > "$tmp/engine_only.cpp"
# Eigen lives in /usr/include/eigen3, off the default search path: an Eigen include fails here.
g++ -std=c++20 -fsyntax-only -I"$prefix/include" "$tmp/engine_only.cpp" \
  || fail "<shardswap/engine.h> does not compile with -I<prefix>/include alone"
lines="$(g++ -std=c++20 -E -I"$prefix/include" "$tmp/engine_only.cpp" | wc -l)"
say "installed include/ holds $(echo "$installed" | wc -l) public headers and nothing else;" \
    "<shardswap/engine.h> compiles with -I<prefix>/include alone (no Eigen), $lines preprocessed lines"

# 3. pkg-config, static: the link-only dependencies come from Requires.private / Libs.private.
pc_dir="$(dirname "$(find "$prefix" -name shardswap.pc)")"
export PKG_CONFIG_PATH="$pc_dir"
say "pkg-config --cflags --libs shardswap: $(pkg-config --cflags --libs shardswap)"
if [ $sanitized -eq 1 ]; then
  for part in cflags libs; do
    pkg-config --"$part" shardswap | grep -q -- '-fsanitize=address,undefined' \
      || fail "a sanitized build's shardswap.pc lacks -fsanitize=address,undefined in its $part"
  done
  grep -q 'INTERFACE_LINK_OPTIONS "-fsanitize=address,undefined"' \
    "$(find "$prefix" -name ShardSwapTargets.cmake | head -1)" \
    || fail "a sanitized build's ShardSwap::shardswap does not hand consumers its link flags"
  say "sanitized: shardswap.pc (Cflags, Libs) and ShardSwap::shardswap hand consumers -fsanitize=address,undefined"
fi
pc_flags="$(pkg-config --cflags --static --libs shardswap fmt)"
# shellcheck disable=SC2086  # the flags are words
g++ -o "$tmp/pc_custom_trainer" tools/examples/custom_trainer.cpp $pc_flags \
  || fail "custom_trainer.cpp does not build with pkg-config --static --libs shardswap fmt"
# cudart and NCCL (CUDA builds) are shared libraries outside the loader's default path.
ld_path="$(pkg-config --static --libs-only-L shardswap | sed 's/-L//g; s/  */:/g; s/^://; s/:$//')"
rc=0; LD_LIBRARY_PATH="$ld_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$tmp/pc_custom_trainer" \
  > "$tmp/pc-run.log" 2>&1 || rc=$?
[ $rc -eq 0 ] || { cat "$tmp/pc-run.log"; fail "the pkg-config-built example exited $rc"; }
say "pkg-config: custom_trainer.cpp built with pkg-config --static flags and ran, exit 0"

if [ $sanitized -eq 1 ]; then
  say "add_subdirectory: skipped for a sanitized build (it builds a library of its own)"
  say "all consumer checks passed"
  exit 0
fi
# 4. add_subdirectory, CPU only (a sub-project defaults to SHARDSWAP_CUDA=OFF; set here too so
# the check does not depend on that default): rebuilds the library, so it is the slow part.
start=$SECONDS
sub="$tmp/add_subdirectory"
cmake -S tests/consumer/add_subdirectory -B "$sub" -G Ninja -DSHARDSWAP_SOURCE_DIR="$root" \
  -DSHARDSWAP_CUDA=OFF > "$tmp/sub-configure.log" \
  || { cat "$tmp/sub-configure.log"; fail "configuring the add_subdirectory consumer"; }
grep 'ShardSwap sub-project' "$tmp/sub-configure.log" | sed 's/^-- /consumer-check: /'
cmake --build "$sub" -j "$jobs" > "$tmp/sub-build.log" \
  || { cat "$tmp/sub-build.log"; fail "building the add_subdirectory consumer"; }
rc=0; "$sub/consumer_custom_trainer" > "$tmp/sub-run.log" 2>&1 || rc=$?
[ $rc -eq 0 ] || { cat "$tmp/sub-run.log"; fail "the add_subdirectory consumer exited $rc"; }
say "add_subdirectory: library and custom_trainer built ($(grep -c 'Building' "$tmp/sub-build.log") compile steps) and ran, exit 0 ($((SECONDS - start)) s)"
say "all consumer checks passed"
