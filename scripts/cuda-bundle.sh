#!/bin/sh
# Builds the CUDA tests, the benchmarks (llmem-bench and the llmem-bench-cuda-* kernels) and the
# CLI (Release, LLMEM_CUDA=ON) in build-gpu/ and packs them, with the shared libraries they need
# beyond the C runtime and CUDA, into build-gpu-pack/bundle.tar.xz: for a GPU machine that has the
# CUDA toolkit but not this project's build dependencies. There:
#   tar -xJf bundle.tar.xz && cd bundle && LD_LIBRARY_PATH=$PWD/lib ./test-cuda
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cmake -S . -B build-gpu -DLLMEM_CUDA=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-gpu -j"$(nproc)" >/dev/null
rm -rf build-gpu-pack && mkdir -p build-gpu-pack/bundle/lib
bins="build-gpu/llmem build-gpu/llmem-bench \
      $(find build-gpu build-gpu/tests -maxdepth 1 -type f -perm -u+x \
      \( -name 'test-cuda*' -o -name 'test-backend' -o -name 'llmem-bench-*' \) 2>/dev/null || true)"
for b in $bins; do
    cp "$b" build-gpu-pack/bundle/
    # every library resolved under /lib or /usr/lib except the C and C++ runtimes
    ldd "$b" | awk '$3 ~ /^\/(usr\/)?lib/ {print $3}' |
        grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|libdl|libpthread|librt)\.so' |
        while read -r lib; do cp -Lu "$lib" build-gpu-pack/bundle/lib/; done || true
done
strip build-gpu-pack/bundle/lib/* 2>/dev/null || true
tar -C build-gpu-pack -cJf build-gpu-pack/bundle.tar.xz bundle
rm -rf build-gpu-pack/bundle
ls -l build-gpu-pack/bundle.tar.xz
