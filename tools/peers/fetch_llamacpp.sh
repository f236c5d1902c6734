#!/usr/bin/env bash
# Fetch the llama.cpp source for the H200 comparison (tools/bench_h200.sh) and pack it small
# enough to travel with a device call.  Run HERE (the development machine): the GPU machine has
# no network.
#
#   bash tools/peers/fetch_llamacpp.sh            -> .device/peers/llama.cpp-src.tar.gz (~7 MB)
#
# The source is the llama.cpp tree vendored in PyPI's llama-cpp-python sdist (a pinned,
# hash-checked download through pip, so every run of the comparison builds the same llama.cpp).
# The trim keeps what a CUDA build of llama-bench needs, plus gguf-py and the Qwen3.5 vocab that
# tools/peers/make_synth_gguf.py reads; the rest (web UI, tests, other backends, most vocab files)
# is 70 MB that would not fit in a call's 64 MiB beside the repository.
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT_TAR=${1:-$ROOT/.device/peers/llama.cpp-src.tar.gz}
PY=${PYTHON:-python3}

TMP=$(mktemp -d /tmp/lily-llamacpp-fetch.XXXXXX)
trap 'rm -rf "$TMP"' EXIT

# --no-deps: only this sdist; --no-binary: the source distribution, never a prebuilt wheel.
"$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION" -d "$TMP/dl"
SDIST=$(ls "$TMP"/dl/llama_cpp_python-"$VERSION".tar.gz)
echo "sdist: $(basename "$SDIST") sha256 $(sha256sum "$SDIST" | cut -d' ' -f1)"
tar -xzf "$SDIST" -C "$TMP"
SRC=$TMP/llama_cpp_python-$VERSION/vendor/llama.cpp
[ -f "$SRC/CMakeLists.txt" ] || { echo "no vendor/llama.cpp in $SDIST" >&2; exit 1; }

# Trim (same list as the reference pack_source.sh).
mv "$SRC" "$TMP/llama.cpp"
cd "$TMP/llama.cpp"
# VCS / CI / docs / media / tests / examples: not needed to build llama-bench
rm -rf .git .github .devops .gemini .pi docs media tests examples pocs benches skills ci \
       conversion convert_*.py requirements requirements.txt
# models: keep only the Qwen3.5 vocabulary (the generator copies its tokenizer from it)
find models -mindepth 1 ! -name 'ggml-vocab-qwen35.gguf' -exec rm -rf {} +
[ -f models/ggml-vocab-qwen35.gguf ] || { echo "models/ggml-vocab-qwen35.gguf missing" >&2; exit 1; }
# tools only built with LLAMA_BUILD_SERVER=ON (the web UI assets are the bulk)
rm -rf tools/ui tools/server tools/cli
# ggml backends that are not built (GGML_<BACKEND>=OFF skips their add_subdirectory)
for b in blas cann et hexagon hip metal musa opencl openvino rpc sycl virtgpu vulkan webgpu zdnn zendnn; do
  rm -rf "ggml/src/ggml-$b"
done
# generator of the CUDA template instances: the generated .cu files are already there
rm -f ggml/src/ggml-cuda/template-instances/generate_cu_files.py
cd "$TMP"

mkdir -p "$(dirname "$OUT_TAR")"
# A record of where the tree came from travels inside the tarball.
echo "llama-cpp-python $VERSION sdist $(basename "$SDIST") sha256 $(sha256sum "$SDIST" | cut -d' ' -f1)" \
    > llama.cpp/SOURCE-lily.txt
tar -czf "$OUT_TAR.tmp" llama.cpp
mv "$OUT_TAR.tmp" "$OUT_TAR"
echo "wrote $OUT_TAR ($(du -h "$OUT_TAR" | cut -f1), $(tar -tzf "$OUT_TAR" | wc -l) entries)"
