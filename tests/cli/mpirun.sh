#!/bin/sh
# mpirun as the suite runs it: Open MPI as CI has it (as root, more ranks than cores, no network
# but the machine's own shared memory). Other MPIs get plain `mpirun -np N`.
# Usage: mpirun.sh NP PROGRAM [ARGS...]   (MPIRUN=... names another mpirun)
np=$1
shift
mpirun=${MPIRUN:-mpirun}
version=$("$mpirun" --version 2>/dev/null | head -1)
case $version in
  *"Open MPI"*|*"OpenRTE"*)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    # Under AddressSanitizer (the asan preset): Open MPI 4.1 frees little of what MPI_Init took
    # and unloads the plugins that took it, so LeakSanitizer reports dozens of leaks at every
    # rank's exit that no suppression can name (their frames are in unloaded modules). Leak
    # checks are off for the ranks; every other report (use after free, overflow, UB) still fails.
    [ -n "${ASAN_OPTIONS:-}" ] && export ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0"
    # The shared-memory transport is "vader" in Open MPI 4 and "sm" from 5 on.
    case $version in
      *" 4."*|*" 3."*) btl=self,vader ;;
      *) btl=self,sm ;;
    esac
    exec "$mpirun" --oversubscribe --bind-to none --mca btl "$btl" -np "$np" "$@" ;;
  *)
    exec "$mpirun" -np "$np" "$@" ;;
esac
