#!/usr/bin/env bash
# Builds host_index's C extension once with AddressSanitizer + UBSan, in a
# temporary copy of the sources, and runs the host_index tests against it.
# Usage: PYTHON=.venv/bin/python bash .ci/host_index_sanitizers.sh
# Exits nonzero on a build failure, a test failure or any sanitizer report.
set -euo pipefail
PYTHON="${PYTHON:-python}"
# Resolve a relative interpreter path before changing directory.
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/host_index_asan.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

cp -r "$ROOT/host_index" "$ROOT/setup.py" "$ROOT/setup.cfg" "$WORK/"
mkdir -p "$WORK/tests"
cp "$ROOT"/tests/test_host_index_*.py "$WORK/tests/"
find "$WORK/host_index" -name '*.so' -delete
rm -rf "$WORK/host_index/__pycache__"
touch "$WORK/README.md"  # setup.cfg reads it as the long description

cd "$WORK"
KVJAX_SANITIZE=1 "$PYTHON" setup.py -q build_ext --inplace

LIBASAN="$(${CC:-gcc} -print-file-name=libasan.so)"
# CPython leaks by design at exit; everything else must be clean.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_string_checks=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export LD_PRELOAD="$LIBASAN"
export PYTHONPATH="$WORK"
export OMP_NUM_THREADS=2
# Prove the sanitized build is the one under test, then run the tests.
"$PYTHON" -c "import host_index._core as c, sys; assert c.__file__.startswith('$WORK'), c.__file__"
"$PYTHON" -m pytest -q -p no:cacheprovider "$WORK/tests"
