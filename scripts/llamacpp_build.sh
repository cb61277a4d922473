#!/usr/bin/env bash
# Build llama.cpp (CPU only) from the llama-cpp-python source distribution,
# once per machine, and the oracle program scripts/llamacpp/logits.cpp
# against it. Prints the path of the ptxgen-logits binary on its last line.
#
# Environment:
#   PTXGEN_CACHE_DIR   cache root (default ~/.cache/ptxgen); the build lives in
#                      $PTXGEN_CACHE_DIR/llama.cpp-$LLAMACPP_PY_VERSION
#   LLAMACPP_PY_VERSION  llama-cpp-python version (default 0.3.36)
#   LLAMACPP_SDIST     a local llama_cpp_python-<version>.tar.gz (otherwise it is
#                      looked for in the cache, then fetched with pip download)
#   LLAMACPP_CMAKE_ARGS  extra cmake arguments (e.g. -DGGML_AVX2=ON)
#   JOBS               parallel compile jobs (default 2)
#
# A second run with the same inputs does nothing but print the path.
set -euo pipefail

VERSION=${LLAMACPP_PY_VERSION:-0.3.36}
CACHE=${PTXGEN_CACHE_DIR:-$HOME/.cache/ptxgen}
DEST=$CACHE/llama.cpp-$VERSION
SRC=$DEST/src
BUILD=$DEST/build
BIN=$BUILD/ptxgen-logits
JOBS=${JOBS:-2}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ORACLE_DIR=$HERE/llamacpp
PYTHON=${PYTHON:-python3}

CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DLLAMA_SRC="$SRC"
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DGGML_CUDA=OFF
    -DGGML_METAL=OFF
    -DGGML_VULKAN=OFF
    -DGGML_BACKEND_DL=OFF
    -DGGML_OPENMP=OFF
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_COMMON=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_TOOLS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF
    -DLLAMA_BUILD_APP=OFF
)
# shellcheck disable=SC2206
EXTRA=(${LLAMACPP_CMAKE_ARGS:-})

# The stamp names everything the binary depends on: a change in any rebuilds.
stamp_text() {
    printf 'version=%s\n' "$VERSION"
    printf 'cmake=%s\n' "${CMAKE_ARGS[*]} ${EXTRA[*]:-}"
    sha256sum "$ORACLE_DIR/logits.cpp" "$ORACLE_DIR/CMakeLists.txt" | awk '{print $1}'
}
STAMP=$DEST/build.stamp
# taken before building, so that a source edited during the build is rebuilt next time
WANT=$(stamp_text)
if [[ -x $BIN && -f $STAMP ]] && [[ "$WANT" == "$(cat "$STAMP")" ]]; then
    echo "llama.cpp oracle up to date"
    echo "$BIN"
    exit 0
fi

for tool in cmake tar c++; do
    command -v "$tool" >/dev/null || { echo "llamacpp_build: '$tool' not found on PATH" >&2; exit 1; }
done
mkdir -p "$DEST"

# 1. the source distribution
if [[ ! -f $SRC/include/llama.h ]]; then
    SDIST=${LLAMACPP_SDIST:-$CACHE/llama_cpp_python-$VERSION.tar.gz}
    if [[ ! -f $SDIST ]]; then
        echo "fetching llama-cpp-python==$VERSION (source distribution) into $CACHE"
        "$PYTHON" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
            -d "$CACHE" "llama-cpp-python==$VERSION" \
            || "$PYTHON" -m pip download -q --no-deps --no-binary :all: \
                   -d "$CACHE" "llama-cpp-python==$VERSION"
        SDIST=$CACHE/llama_cpp_python-$VERSION.tar.gz
    fi
    [[ -f $SDIST ]] || { echo "llamacpp_build: no source distribution at $SDIST" >&2; exit 1; }
    echo "unpacking vendor/llama.cpp from $SDIST"
    TMP=$(mktemp -d "$DEST/unpack.XXXXXX")
    tar -xzf "$SDIST" -C "$TMP" --strip-components=3 \
        "llama_cpp_python-$VERSION/vendor/llama.cpp"
    [[ -f $TMP/include/llama.h ]] || { echo "llamacpp_build: $SDIST has no vendor/llama.cpp" >&2; exit 1; }
    rm -rf "$SRC"
    mv "$TMP" "$SRC"
fi

# 2. configure and build only the library and the oracle
echo "building llama.cpp (CPU) in $BUILD with -j$JOBS"
cmake -S "$ORACLE_DIR" -B "$BUILD" "${CMAKE_ARGS[@]}" ${EXTRA[@]+"${EXTRA[@]}"} >"$DEST/configure.log" 2>&1 \
    || { echo "llamacpp_build: cmake configure failed; see $DEST/configure.log" >&2; tail -20 "$DEST/configure.log" >&2; exit 1; }
cmake --build "$BUILD" --target ptxgen-logits -j "$JOBS"
[[ -x $BIN ]] || { echo "llamacpp_build: $BIN was not produced" >&2; exit 1; }
printf '%s\n' "$WANT" >"$STAMP"
echo "$BIN"
