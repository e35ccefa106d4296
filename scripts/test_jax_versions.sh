#!/usr/bin/env bash
# Runs vjpkit's whole test suite against each JAX version given, each in its
# own virtual environment, and prints one table row per version.
#
#   scripts/test_jax_versions.sh 0.4.38 0.10.2            # the whole suite
#   scripts/test_jax_versions.sh 0.4.38 -- tests/test_x.py -x   # pytest args after --
#   scripts/test_jax_versions.sh --setup-only 0.5.3       # build the venv only
#   scripts/test_jax_versions.sh --show-output 0.4.38     # pytest's output too (CI)
#
# Each venv ($VJPKIT_VENVS/jax-VERSION, default /work/venvs) is built once and
# reused: first jax==V and jaxlib==V alone, then `pip install -e .` exactly as a
# user would, which must leave that JAX in place (checked), then the test,
# examples and ecosystem extras and torch's CPU wheel, resolved under a
# constraint that pins jax and jaxlib, so pip picks the chex, optax, equinox and
# flax releases that accept that JAX. The tests import this checkout's src/.
# Exits non-zero when any version fails to install or has a failing test.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${VJPKIT_VENVS:-/work/venvs}
PYTHON=${PYTHON:-python3}
EXTRAS=${VJPKIT_EXTRAS:-test,examples,ecosystem}
TORCH=${VJPKIT_TORCH:-torch==2.13.0}

setup_only=0
show_output=0
versions=()
while [ $# -gt 0 ]; do
    case "$1" in
        --setup-only) setup_only=1 ;;
        --show-output) show_output=1 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) versions+=("$1") ;;
    esac
    shift
done
pytest_args=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    echo "usage: $0 [--setup-only] VERSION... [-- PYTEST_ARGS...]" >&2
    exit 2
fi

installed_jax() {  # prints "jax-version jaxlib-version" of a venv's python
    "$1" -c 'import importlib.metadata as m; print(m.version("jax"), m.version("jaxlib"))' 2>/dev/null
}

setup_venv() {  # setup_venv VERSION: build or refresh $VENVS/jax-VERSION
    local v=$1 venv="$VENVS/jax-$1" py="$VENVS/jax-$1/bin/python"
    if [ "$(installed_jax "$py")" != "$v $v" ]; then
        rm -rf "$venv"
        mkdir -p "$VENVS"
        "$PYTHON" -m venv "$venv" || return 1
        "$py" -m pip install -q "jax==$v" "jaxlib==$v" || return 1
    fi
    printf 'jax==%s\njaxlib==%s\n' "$v" "$v" > "$venv/constraints.txt"
    # A user's `pip install -e .` beside the JAX they have must not replace it.
    "$py" -m pip install -q -e "$REPO" || return 1
    if [ "$(installed_jax "$py")" != "$v $v" ]; then
        echo "pip install -e . changed JAX $v to $(installed_jax "$py")" >&2
        return 1
    fi
    "$py" -m pip install -q -c "$venv/constraints.txt" -e "$REPO[$EXTRAS]" "$TORCH" || return 1
    [ "$(installed_jax "$py")" = "$v $v" ]
}

rows=()
status=0
for v in "${versions[@]}"; do
    venv="$VENVS/jax-$v"
    echo "=== JAX $v: setting up $venv" >&2
    if ! setup_venv "$v"; then
        rows+=("$(printf '%-8s  %s' "$v" "install failed")")
        status=1
        continue
    fi
    [ $setup_only -eq 1 ] && continue
    log="$venv/pytest.log"
    echo "=== JAX $v: running the tests (log: $log)" >&2
    start=$(date +%s)
    if [ $show_output -eq 1 ]; then
        (cd "$REPO" && PYTHONPATH="$REPO/src" "$venv/bin/python" -m pytest -p no:cacheprovider "${pytest_args[@]}") \
            2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    else
        (cd "$REPO" && PYTHONPATH="$REPO/src" "$venv/bin/python" -m pytest -p no:cacheprovider "${pytest_args[@]}") \
            > "$log" 2>&1
        rc=$?
    fi
    secs=$(( $(date +%s) - start ))
    tail -n 1 "$log" >&2
    count() { grep -oE "[0-9]+ $1" <(tail -n 1 "$log") | head -n 1 | cut -d' ' -f1; }
    passed=$(count passed); failed=$(count failed); errors=$(count 'errors?'); skipped=$(count skipped)
    [ $rc -ne 0 ] && status=1
    rows+=("$(printf '%-8s  %6s  %6s  %7s  %4s  %6ss' "$v" "${passed:-0}" "$(( ${failed:-0} + ${errors:-0} ))" \
        "${skipped:-0}" "$rc" "$secs")")
done

echo
if [ $setup_only -eq 1 ]; then
    printf '%s\n' "${rows[@]:-all venvs ready}"
else
    printf '%-8s  %6s  %6s  %7s  %4s  %7s\n' "JAX" "passed" "failed" "skipped" "exit" "time"
    printf '%s\n' "${rows[@]}"
fi
exit $status
