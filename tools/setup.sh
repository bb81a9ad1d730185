#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs maverick-jax into it (editable).
#   bash tools/setup.sh         # runtime dependencies
#   bash tools/setup.sh test    # plus the test extra
set -euo pipefail
cd "$(dirname "$0")/.."

ok() { "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local c v
  for c in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && ok "$c" && { command -v "$c"; return; }
  done
  # pyenv keeps versions that its shims only expose when selected.
  if command -v pyenv >/dev/null 2>&1; then
    # Prefer 3.12 (what the GPU image runs), then newer.
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -V -r) \
             $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[3-9]|[2-9][0-9])(\.|$)' | sort -V); do
      c="$(pyenv root)/versions/$v/bin/python3"
      [ -x "$c" ] && ok "$c" && { echo "$c"; return; }
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ] || ! ok .venv/bin/python; then
  py="$(find_python)" || {
    echo "error: maverick-jax needs Python >= 3.12 (JAX >= 0.11 does). Install one (e.g." \
         "'pyenv install 3.12') or point PYTHON=/path/to/python3.12 at it." >&2
    exit 1
  }
  echo "using $py ($("$py" --version 2>&1))"
  rm -rf .venv
  "$py" -m venv .venv
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extra}"
