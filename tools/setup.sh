#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 and installs maverick-jax into it (editable).
#   bash tools/setup.sh         # runtime dependencies
#   bash tools/setup.sh test    # plus the test extra and the docs toolchain (CI builds the site)
#   bash tools/setup.sh docs    # plus the docs toolchain (docs/requirements.txt): mkdocs serve / build
#   bash tools/setup.sh cuda12  # plus the CUDA 12 (or cuda13: CUDA 13) build of the same jax, for a GPU host
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
docs=0
case "${1:-}" in
  "") ;;
  test) extra="[test]"; docs=1 ;;
  docs) docs=1 ;;
  cuda12|cuda13) extra="[$1]" ;;
  *) echo "error: tools/setup.sh takes no argument, or one of: test, docs, cuda12, cuda13 (got '$1')" >&2
     exit 2 ;;
esac
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extra}"
if [ "$docs" = 1 ]; then
  # The site's toolchain, pinned (mkdocs.yml; tests/test_docs.py builds the site with it).
  .venv/bin/python -m pip install -q -r docs/requirements.txt
fi
if [ "$extra" = "[cuda12]" ] || [ "$extra" = "[cuda13]" ]; then
  # The CUDA plugin must match the jax it runs under exactly: pin it to the installed jax.
  v="$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
  .venv/bin/python -m pip install -q "jax[${1}]==${v}"
fi
