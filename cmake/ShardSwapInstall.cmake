# Install rules and the ShardSwap CMake package (SHARDSWAP_INSTALL, root CMakeLists.txt):
#   <prefix>/lib/libshardswap.a
#   <prefix>/include/shardswap/*.h                  the public headers, nothing internal
#   <prefix>/lib/cmake/ShardSwap/                   config, version, targets, FindNCCL.cmake
#   <prefix>/lib/pkgconfig/shardswap.pc
# The config, version and FindNCCL files are also written to the build tree beside the exported
# targets, so -DShardSwap_DIR=<build dir> works without installing.
include(CMakePackageConfigHelpers)
set(shardswap_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/ShardSwap)

install(TARGETS shardswap EXPORT ShardSwapTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# Each module's include/ holds only shardswap/*.h; the internal headers stay in the source tree.
foreach(module memory optimizer partition engine)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${module}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endforeach()
install(EXPORT ShardSwapTargets NAMESPACE ShardSwap:: DESTINATION ${shardswap_cmake_dir})
export(EXPORT ShardSwapTargets NAMESPACE ShardSwap:: FILE ${PROJECT_BINARY_DIR}/ShardSwapTargets.cmake)

# What the config file needs to find the link-only dependencies the way this build found them.
if(SHARDSWAP_WITH_CUDA)
  get_filename_component(SHARDSWAP_CUDA_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  get_filename_component(SHARDSWAP_NCCL_LIBRARY_DIR "${NCCL_LIBRARY}" DIRECTORY)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ShardSwapConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/ShardSwapConfig.cmake
                              INSTALL_DESTINATION ${shardswap_cmake_dir})
# SameMinorVersion: while ShardSwap is 0.x, a minor release (0.1 -> 0.2) may change the API, so
# a consumer asking for 0.1 accepts 0.1.z only; patch releases keep the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ShardSwapConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
configure_file(${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake ${PROJECT_BINARY_DIR}/FindNCCL.cmake COPYONLY)
install(FILES ${PROJECT_BINARY_DIR}/ShardSwapConfig.cmake
              ${PROJECT_BINARY_DIR}/ShardSwapConfigVersion.cmake
              ${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake
        DESTINATION ${shardswap_cmake_dir})

# pkg-config. Relocatable: prefix is found from the .pc file's own place (${pcfiledir}), so
# `cmake --install --prefix <dir>` gives a working file wherever it lands. Static library: the
# link-only dependencies are in Requires.private / Libs.private (pkg-config --static --libs).
file(RELATIVE_PATH shardswap_pc_to_prefix "${CMAKE_INSTALL_FULL_LIBDIR}/pkgconfig"
     "${CMAKE_INSTALL_PREFIX}")
string(REGEX REPLACE "/$" "" shardswap_pc_to_prefix "${shardswap_pc_to_prefix}")
foreach(dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
    set(shardswap_pc_${dir} "${CMAKE_INSTALL_${dir}}")
  else()
    set(shardswap_pc_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
  endif()
endforeach()
set(shardswap_pc_libs_private "-pthread")
if(SHARDSWAP_WITH_CUDA)
  # Neither cudart nor NCCL ships a .pc file: their directories as this build found them.
  string(APPEND shardswap_pc_libs_private
         " -L${CUDAToolkit_LIBRARY_DIR} -lcudart -L${SHARDSWAP_NCCL_LIBRARY_DIR} -lnccl")
endif()
if(SHARDSWAP_WITH_MPI)  # the MPI communicator (shardswap/mpi.h), with or without CUDA
  foreach(lib IN LISTS MPI_CXX_LIBRARIES)
    string(APPEND shardswap_pc_libs_private " ${lib}")
  endforeach()
endif()
# A sanitized build's flags, which every consumer needs (root CMakeLists.txt).
set(shardswap_pc_sanitize "")
if(SHARDSWAP_SANITIZE)
  string(JOIN " " shardswap_pc_sanitize ${shardswap_consumer_sanitize_flags})
  string(PREPEND shardswap_pc_sanitize " ")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/shardswap.pc.in ${PROJECT_BINARY_DIR}/shardswap.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/shardswap.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
