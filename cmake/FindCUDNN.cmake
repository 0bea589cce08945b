# Finds cuDNN 9 (its C graph API, cudnn_graph.h, and libcudnn): the CUDA toolkit's copy
# (/usr/local/cuda) or Debian's packages (libcudnn9-dev-cuda-*: /usr/include/x86_64-linux-gnu,
# /usr/lib/x86_64-linux-gnu). CUDNN_ROOT, the user's own choice, comes first. Defines CUDNN::cudnn
# and CUDNN_VERSION ("major.minor.patch", read from cudnn_version.h).
find_path(CUDNN_INCLUDE_DIR cudnn_graph.h
          HINTS ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_INCLUDE_DIRS}
          PATH_SUFFIXES include
          PATHS /usr/local/cuda/include /usr/include/x86_64-linux-gnu /usr/include)
find_library(CUDNN_LIBRARY cudnn
             HINTS ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_LIBRARY_DIR}
             PATH_SUFFIXES lib64 lib
             PATHS /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
if(CUDNN_INCLUDE_DIR AND EXISTS ${CUDNN_INCLUDE_DIR}/cudnn_version.h)
  file(STRINGS ${CUDNN_INCLUDE_DIR}/cudnn_version.h cudnn_version_lines
       REGEX "^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) +[0-9]+")
  foreach(part MAJOR MINOR PATCHLEVEL)
    string(REGEX REPLACE ".*CUDNN_${part} +([0-9]+).*" "\\1" cudnn_${part} "${cudnn_version_lines}")
  endforeach()
  set(CUDNN_VERSION "${cudnn_MAJOR}.${cudnn_MINOR}.${cudnn_PATCHLEVEL}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CUDNN REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR
                                  VERSION_VAR CUDNN_VERSION)
if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn UNKNOWN IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES IMPORTED_LOCATION ${CUDNN_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${CUDNN_INCLUDE_DIR})
endif()
mark_as_advanced(CUDNN_INCLUDE_DIR CUDNN_LIBRARY)
