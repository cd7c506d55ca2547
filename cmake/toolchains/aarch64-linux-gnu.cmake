# Cross-compiles for aarch64 Linux on a Debian x86-64 host (scripts/arm-check.sh):
#   cmake -S . -B build-arm64 -G Ninja \
#     -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake -DMJOLNIR_CUDA=OFF
# Needs g++-aarch64-linux-gnu (the cross compiler and its libc in /usr/aarch64-linux-gnu), the
# arm64 copies of the libraries from Debian's multiarch archive (libhwy-dev:arm64,
# libgtest-dev:arm64: libraries and CMake packages in /usr/lib/aarch64-linux-gnu, headers shared
# in /usr/include), and qemu-user-static (or qemu-user), through which CMake runs what it built
# (gtest_discover_tests at build time, then ctest).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(mjolnir_triplet aarch64-linux-gnu)

set(CMAKE_C_COMPILER ${mjolnir_triplet}-gcc)
set(CMAKE_CXX_COMPILER ${mjolnir_triplet}-g++)

# Debian multiarch: find_library / find_package search <prefix>/lib/aarch64-linux-gnu (and its
# cmake/ folder) instead of the host's /usr/lib/x86_64-linux-gnu. The cross compiler's own
# sysroot comes first; "/" keeps the shared /usr/include and the arch-independent CMake packages
# (nlohmann_json, CLI11 in /usr/share/cmake) visible. Programs are the host's.
set(CMAKE_LIBRARY_ARCHITECTURE ${mjolnir_triplet})
set(CMAKE_FIND_ROOT_PATH /usr/${mjolnir_triplet} /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# Never the host architecture's libraries or CMake packages (e.g. the amd64 hwy and GTest
# configs in /usr/lib/x86_64-linux-gnu/cmake), even through a fallback search.
if(CMAKE_HOST_SYSTEM_PROCESSOR)
  set(mjolnir_host_libdir /usr/lib/${CMAKE_HOST_SYSTEM_PROCESSOR}-linux-gnu)
  file(GLOB mjolnir_host_packages LIST_DIRECTORIES true ${mjolnir_host_libdir}/cmake/*)
  list(APPEND CMAKE_IGNORE_PATH ${mjolnir_host_libdir} ${mjolnir_host_packages})
  list(REMOVE_DUPLICATES CMAKE_IGNORE_PATH)  # this file is read again by every try_compile
endif()

# pkg-config (for any dependency found through it): the arm64 .pc files only.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/${mjolnir_triplet}/pkgconfig:/usr/share/pkgconfig")
find_program(mjolnir_cross_pkg_config ${mjolnir_triplet}-pkg-config)
if(mjolnir_cross_pkg_config)
  set(PKG_CONFIG_EXECUTABLE ${mjolnir_cross_pkg_config} CACHE FILEPATH "pkg-config for aarch64")
endif()

# Run aarch64 executables under qemu's user-mode emulator: ctest and gtest_discover_tests use
# CMAKE_CROSSCOMPILING_EMULATOR. The CPU is qemu's default, "max" (every feature it emulates:
# SVE and SVE2, 512-bit vectors), or what QEMU_CPU says at run time: scripts/arm-check.sh sets
# QEMU_CPU=max,sve-default-vector-length=16, 128-bit vectors, as Neoverse V2 / N2 cores have.
# The dynamic loader and libc must come from one glibc build. libhwy1:arm64 pulls in Debian's
# multiarch libc6:arm64 (/lib/ld-linux-aarch64.so.1, /lib/aarch64-linux-gnu): when it is there,
# qemu runs with the host's paths and that runtime. `-L /usr/aarch64-linux-gnu` (the cross
# toolchain's libc6-arm64-cross) would load that sysroot's ld.so but still find libc.so.6 first
# in /lib/aarch64-linux-gnu; with the two at different Debian revisions (2.36-8cross1 against
# 2.36-9+deb12u14 on Debian 12) the first pthread_create hangs. -L is used only without the
# multiarch libc, where the sysroot has the whole runtime.
find_program(mjolnir_qemu_aarch64 NAMES qemu-aarch64-static qemu-aarch64)
if(mjolnir_qemu_aarch64)
  if(EXISTS /lib/ld-linux-aarch64.so.1)
    set(CMAKE_CROSSCOMPILING_EMULATOR ${mjolnir_qemu_aarch64})
  else()
    set(CMAKE_CROSSCOMPILING_EMULATOR ${mjolnir_qemu_aarch64} -L /usr/${mjolnir_triplet})
  endif()
endif()
