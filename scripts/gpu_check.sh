#!/usr/bin/env bash
# The GPU check: what only a machine with an NVIDIA GPU can run, in one go,
# within about 8 minutes (the suite is bounded by a timeout; every step's log
# goes to a file and a summary is printed at the end).
#
#     bash scripts/gpu_check.sh             # on the GPU machine, from any directory
#     bash scripts/gpu_check.sh --dry-run   # prints the steps, runs nothing (CI runs this)
#
# Steps, each with its own time limit, all within BUDGET_S seconds in all:
#   1. environment: JAX's default backend must be the GPU; versions, nvcc;
#   2. the tests the last GPU run failed (scripts/gpu_known_failures.txt), then
#      the whole test suite, with the GPU as JAX's default backend (WORKERS
#      processes, SUITE_TIMEOUT_S at most);
#   3. the Pallas examples compiled for the GPU (examples/pallas_layernorm.py,
#      examples/pallas_attention.py: the attention kernels against plain attention);
#   4. the CUDA load_inline example (examples/cuda_kernel.py, where it exists);
#   5. from_torch on CUDA and its figures (benchmarks/from_torch.py --quick,
#      with --device gpu where it takes that option);
#   6. the GPU benchmarks (benchmarks/transformer.py --device gpu --quick, where
#      that script takes --device), with the time that is left.
# Nothing is installed (the GPU machine may have no network): vjpkit is
# imported from this checkout (PYTHONPATH), with the Python in $PYTHON
# (python3 by default). Logs go to $OUT/gpu_check if OUT is set, else to a
# temporary directory, named in the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-480}         # all steps together: the device time is scarce
# The suite took over 285 s with 15 workers on an H200 (JAX 0.11.2, 2026-11-28): compiling for a GPU is slower.
SUITE_TIMEOUT_S=${SUITE_TIMEOUT_S:-300}
WORKERS=${WORKERS:-15}
if [ "$DRY_RUN" = 1 ]; then LOGS="(none: a dry run)"
elif [ -n "${OUT:-}" ]; then LOGS="$OUT/gpu_check"; mkdir -p "$LOGS"
else LOGS=$(mktemp -d)/gpu_check; mkdir -p "$LOGS"
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # 15 test workers share the GPU's memory
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset JAX_PLATFORMS                          # the GPU is JAX's default backend

SUMMARY=()
FAILED=0

# step NAME LIMIT_S COMMAND...: runs COMMAND (in the checkout) with its output in $LOGS/NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - SECONDS))
    if [ "$DRY_RUN" = 1 ]; then
        printf '%-12s (at most %3s s) %s\n' "$name" "$limit" "$(echo "$*" | head -n 1)"
        SUMMARY+=("$(printf '%-12s %-10s' "$name" "dry-run")")
        return 0
    fi
    if [ "$left" -lt 10 ]; then
        SUMMARY+=("$(printf '%-12s %-10s %s' "$name" "SKIPPED" "no time left of the ${BUDGET_S} s budget")")
        FAILED=1
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS status
    echo "== $name: $(echo "$*" | head -n 1) (at most $limit s)"
    # SIGINT first: pytest then prints its summary (the failures so far, with their tracebacks) before it stops.
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    status=$?
    local took=$((SECONDS - start)) verdict=ok
    if [ "$status" = 124 ] || [ "$status" = 137 ]; then verdict=TIMEOUT; FAILED=1
    elif [ "$status" != 0 ]; then verdict="FAILED($status)"; FAILED=1
    fi
    tail -n 15 "$LOGS/$name.log"
    SUMMARY+=("$(printf '%-12s %-10s %4s s  %s' "$name" "$verdict" "$took" "$(tail -n 1 "$LOGS/$name.log" | cut -c1-110)")")
}

# Optional steps: a script that does not exist (yet) is reported, not failed.
absent() {
    SUMMARY+=("$(printf '%-12s %-10s %s' "$1" "absent" "$2")")
}

takes_option() {  # takes_option SCRIPT OPTION: whether SCRIPT --help mentions OPTION
    [ "$DRY_RUN" = 0 ] && timeout 60 "$PYTHON" "$1" --help 2>/dev/null | grep -q -- "$2"
}

step environment 60 "$PYTHON" -c '
import shutil, subprocess, jax
print("jax", jax.__version__, "default backend", jax.default_backend(), jax.devices())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())
except ImportError:
    print("torch: not installed")
nvcc = shutil.which("nvcc")
print("nvcc", nvcc and subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.splitlines()[-1])
assert jax.default_backend() == "gpu", "JAX default backend is not the GPU"
'
if [ "$FAILED" = 1 ]; then  # not a GPU machine (or no JAX): the rest would only run on the CPU
    printf '%s\n' "${SUMMARY[@]}"
    echo "gpu_check: the environment step failed (see above); nothing else was run" >&2
    exit 1
fi

# The tests the last GPU run failed first (scripts/gpu_known_failures.txt: path::test function per line), so
# that their tracebacks come back even if the suite runs out of time. addopts' --maxprocesses would cap the
# workers at 4, so addopts is replaced.
KNOWN_FILES=()
KNOWN_NAMES=""
if [ -f scripts/gpu_known_failures.txt ]; then
    mapfile -t KNOWN_FILES < <(grep -v '^#' scripts/gpu_known_failures.txt | grep . | cut -d: -f1 | sort -u)
    KNOWN_NAMES=$(grep -v '^#' scripts/gpu_known_failures.txt | grep . | sed 's/.*:://' | sort -u | paste -sd ' ' \
        | sed 's/ / or /g')
fi
if [ "${#KNOWN_FILES[@]}" -gt 0 ]; then
    step known 90 "$PYTHON" -m pytest -p no:cacheprovider -o addopts= -q -n "$WORKERS" -rfE --tb=short -k "$KNOWN_NAMES" \
        "${KNOWN_FILES[@]}"
else
    absent known "scripts/gpu_known_failures.txt lists no test"
fi

# Then the whole suite (what matters most, if time runs short), with addopts' --doctest-modules kept (the
# docstrings' examples, src/vjpkit).
step suite "$SUITE_TIMEOUT_S" "$PYTHON" -m pytest -p no:cacheprovider -o addopts= -q -n "$WORKERS" --dist loadfile \
    --doctest-modules -rfE --tb=short --durations=5

step pallas 60 "$PYTHON" examples/pallas_layernorm.py
step attention 60 "$PYTHON" examples/pallas_attention.py   # the compiled kernels against plain attention

if [ -f examples/cuda_kernel.py ]; then
    step cuda_kernel 60 "$PYTHON" examples/cuda_kernel.py
else
    absent cuda_kernel "examples/cuda_kernel.py is not in this checkout"
fi

FROM_TORCH=(benchmarks/from_torch.py --quick)
takes_option benchmarks/from_torch.py --device && FROM_TORCH+=(--device gpu)
step from_torch 60 "$PYTHON" "${FROM_TORCH[@]}"

if takes_option benchmarks/transformer.py --device || [ "$DRY_RUN" = 1 ]; then
    step transformer 90 "$PYTHON" benchmarks/transformer.py --device gpu --quick
else
    absent transformer "benchmarks/transformer.py takes no --device in this checkout"
fi

echo
echo "== GPU check summary ($SECONDS s; logs in $LOGS)"
printf '%s\n' "${SUMMARY[@]}"
[ "$DRY_RUN" = 1 ] || printf '%s\n' "${SUMMARY[@]}" > "$LOGS/summary.txt"
exit "$FAILED"
