# Finds NCCL: the CUDA toolkit's copy (/usr/local/cuda) or the system's (/usr/include,
# /usr/lib/x86_64-linux-gnu). Defines NCCL::NCCL. NCCL_HINT_INCLUDE_DIR / NCCL_HINT_LIBRARY_DIR
# are set by ShardSwapConfig.cmake: where the ShardSwap build found NCCL, searched before the
# toolkit's folders (NCCL_ROOT, the user's own choice, still comes first).
find_path(NCCL_INCLUDE_DIR nccl.h
          HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${NCCL_HINT_INCLUDE_DIR} ${CUDAToolkit_INCLUDE_DIRS}
          PATHS /usr/local/cuda/include /usr/include)
find_library(NCCL_LIBRARY nccl
             HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${NCCL_HINT_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_DIR}
             PATHS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
