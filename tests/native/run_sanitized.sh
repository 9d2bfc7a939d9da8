#!/usr/bin/env bash
# The native tests against the address + undefined-behaviour sanitizer build of the library.
#
#   python -m kvcli.native.build --sanitize     # once: installs kvcli/native/lib/sanitize
#   tests/native/run_sanitized.sh [pytest args]  # e.g. -k compaction
#
# Python itself is not instrumented, so libasan is preloaded and leak detection is off (the
# interpreter's own allocations would drown the report); any heap overflow, use-after-free or
# undefined behaviour in llama.cpp or kvcli's code aborts the test run with a report.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIB="${KVCLI_SANITIZE_LIB_DIR:-kvcli/native/lib/sanitize}"
if [ ! -f "$LIB/libllama.so" ]; then
    echo "no sanitizer build in $LIB: run  python -m kvcli.native.build --sanitize" >&2
    exit 2
fi
ASAN_LIB="$(${CC:-gcc} -print-file-name=libasan.so)"
UBSAN_LIB="$(${CC:-gcc} -print-file-name=libubsan.so)"
export LD_PRELOAD="$ASAN_LIB $UBSAN_LIB"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export KVCLI_LIB_DIR="$LIB"
export KVCLI_THREADS="${KVCLI_THREADS:-1}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/native -m "not slow" "$@"
