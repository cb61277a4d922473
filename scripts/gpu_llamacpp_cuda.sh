#!/usr/bin/env bash
# llama.cpp with CUDA for the peer columns of GPU benchmarks: llama-bench and
# llama-batched-bench, built from the vendored source of the llama-cpp-python
# sdist (unpacked, or a trimmed tarball of its vendor/llama.cpp carried as
# .carry/llcpp.tar.xz), in the background so the rest of a session goes on.
#   scripts/gpu_llamacpp_cuda.sh start   # unpack and build in the background (about 5 min)
#   scripts/gpu_llamacpp_cuda.sh wait    # block until built; prints the bin directory
set -u
DEST=${LLAMACPP_CUDA_DIR:-/tmp/llamacpp-cuda}
case "${1:-start}" in
start)
  mkdir -p "$DEST"
  [ -d "$DEST/llcpp" ] || tar xJf .carry/llcpp.tar.xz -C "$DEST"
  setsid bash -c "cd '$DEST' && cmake -S llcpp -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > configure.log 2>&1 \
      && cmake --build build --target llama-bench llama-batched-bench -j ${JOBS:-12} > build.log 2>&1; \
      echo \$? > build.rc" < /dev/null > /dev/null 2>&1 &
  echo "llama.cpp CUDA build started in $DEST"
  ;;
wait)
  for _ in $(seq 1 ${2:-600}); do [ -f "$DEST/build.rc" ] && break; sleep 1; done
  if [ "$(cat "$DEST/build.rc" 2>/dev/null)" != 0 ]; then
    echo "llama.cpp build failed or unfinished"; tail -5 "$DEST/configure.log" "$DEST/build.log" 2>/dev/null; exit 1
  fi
  echo "$DEST/build/bin"
  ;;
esac
