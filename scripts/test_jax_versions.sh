#!/usr/bin/env bash
# Runs vjpkit's whole test suite against each JAX version given, each in its
# own virtual environment, and prints one table row per version.
#
#   scripts/test_jax_versions.sh 0.4.38 0.10.2            # the whole suite
#   scripts/test_jax_versions.sh 0.12.0.1@python3.13      # on a given Python
#   scripts/test_jax_versions.sh 0.4.38 -- tests/test_x.py -x   # pytest args after --
#   scripts/test_jax_versions.sh --setup-only 0.5.3       # build the venv only
#   scripts/test_jax_versions.sh --show-output 0.4.38     # pytest's output too (CI)
#   scripts/test_jax_versions.sh --which-python 0.12.0.1  # print the Python it would use
#
# Each version runs on the Python after its @ (a command or a path), else on
# $PYTHON (python3) if that JAX supports it, else on the newest Python 3.12 or
# later found (on PATH, or among pyenv's versions): JAX 0.11 and later need
# Python 3.12. Each venv ($VJPKIT_VENVS/jax-VERSION-pyX.Y, default /work/venvs)
# is built once and reused: first jax==V and jaxlib==V alone, then
# `pip install -e .` exactly as a user would, which must leave that JAX in place
# (checked), then the test, examples and ecosystem extras (and torch's CPU
# wheel, which lies on this machine for Python 3.11 only: elsewhere torch is
# left out unless VJPKIT_TORCH names it), resolved under a constraint that
# pins jax and jaxlib, so pip picks the chex, optax, equinox and flax releases
# that accept that JAX. The tests import this checkout's src/.
# Exits non-zero when any version fails to install or has a failing test.
set -uo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${VJPKIT_VENVS:-/work/venvs}
PYTHON=${PYTHON:-python3}
EXTRAS=${VJPKIT_EXTRAS:-test,examples,ecosystem}
TORCH=${VJPKIT_TORCH-auto}

setup_only=0
show_output=0
which_python=0
versions=()
while [ $# -gt 0 ]; do
    case "$1" in
        --setup-only) setup_only=1 ;;
        --show-output) show_output=1 ;;
        --which-python) which_python=1 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) versions+=("$1") ;;
    esac
    shift
done
pytest_args=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    echo "usage: $0 [--setup-only] VERSION... [-- PYTEST_ARGS...]" >&2
    exit 2
fi

python_version() {  # prints "3.12" for a Python command, nothing if it does not run
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

min_python() {  # min_python JAX_VERSION: the oldest Python that JAX release supports
    if [ "$(printf '%s\n' "$1" 0.11 | sort -V | head -n 1)" = 0.11 ]; then echo 3.12; else echo 3.10; fi
}

at_least() {  # at_least 3.12 3.11: whether the first version is >= the second
    [ "$(printf '%s\n' "$1" "$2" | sort -V | head -n 1)" = "$2" ]
}

newest_python() {  # the newest Python 3.12 or later on PATH or among pyenv's versions
    local root candidates=() py v best="" best_v=0
    root=$(pyenv root 2>/dev/null) || root=""
    for v in 3.14 3.13 3.12; do
        candidates+=("python$v")
        [ -n "$root" ] && candidates+=("$root"/versions/"$v".*/bin/python"$v")
    done
    for py in "${candidates[@]}"; do
        v=$(python_version "$py") || continue
        if [ -n "$v" ] && at_least "$v" 3.12 && ! at_least "$best_v" "$v"; then best=$py; best_v=$v; fi
    done
    [ -n "$best" ] && echo "$best"
}

python_for() {  # python_for SPEC: the Python command for VERSION[@PYTHON]
    local spec=$1 v=${1%%@*} py
    if [ "$spec" != "$v" ]; then echo "${spec#*@}"; return; fi
    py=$(python_version "$PYTHON")
    if [ -n "$py" ] && at_least "$py" "$(min_python "$v")"; then echo "$PYTHON"; return; fi
    newest_python || { echo "no Python $(min_python "$v") or later found for JAX $v: give one as $v@PYTHON" >&2; return 1; }
}

if [ $which_python -eq 1 ]; then
    for spec in "${versions[@]}"; do python_for "$spec" || exit 1; done
    exit 0
fi

installed_jax() {  # prints "jax-version jaxlib-version" of a venv's python
    "$1" -c 'import importlib.metadata as m; print(m.version("jax"), m.version("jaxlib"))' 2>/dev/null
}

setup_venv() {  # setup_venv VERSION PYTHON VENV: build or refresh VENV
    local v=$1 base=$2 venv=$3 py="$3/bin/python" torch=$TORCH
    if [ "$(installed_jax "$py")" != "$v $v" ]; then
        rm -rf "$venv"
        mkdir -p "$VENVS"
        "$base" -m venv "$venv" || return 1
        "$py" -m pip install -q "jax==$v" "jaxlib==$v" || return 1
    fi
    printf 'jax==%s\njaxlib==%s\n' "$v" "$v" > "$venv/constraints.txt"
    # A user's `pip install -e .` beside the JAX they have must not replace it.
    "$py" -m pip install -q -e "$REPO" || return 1
    if [ "$(installed_jax "$py")" != "$v $v" ]; then
        echo "pip install -e . changed JAX $v to $(installed_jax "$py")" >&2
        return 1
    fi
    if [ "$torch" = auto ]; then
        torch=""
        [ "$(python_version "$py")" = 3.11 ] && torch=torch==2.13.0
    fi
    [ -z "$torch" ] && echo "=== JAX $v: no torch on Python $(python_version "$py") (the tests that need it skip)" >&2
    "$py" -m pip install -q -c "$venv/constraints.txt" -e "$REPO[$EXTRAS]" $torch || return 1
    [ "$(installed_jax "$py")" = "$v $v" ]
}

rows=()
status=0
for spec in "${versions[@]}"; do
    v=${spec%%@*}
    if ! base=$(python_for "$spec") || [ -z "$(python_version "$base")" ]; then
        rows+=("$(printf '%-8s  %-6s  %s' "$v" "?" "no Python for it")")
        status=1
        continue
    fi
    pyv=$(python_version "$base")
    venv="$VENVS/jax-$v-py$pyv"
    echo "=== JAX $v on Python $pyv: setting up $venv" >&2
    if ! setup_venv "$v" "$base" "$venv"; then
        rows+=("$(printf '%-8s  %-6s  %s' "$v" "$pyv" "install failed")")
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
    rows+=("$(printf '%-8s  %-6s  %6s  %6s  %7s  %4s  %6ss' "$v" "$pyv" "${passed:-0}" \
        "$(( ${failed:-0} + ${errors:-0} ))" "${skipped:-0}" "$rc" "$secs")")
done

echo
if [ $setup_only -eq 1 ]; then
    printf '%s\n' "${rows[@]:-all venvs ready}"
else
    printf '%-8s  %-6s  %6s  %6s  %7s  %4s  %7s\n' "JAX" "Python" "passed" "failed" "skipped" "exit" "time"
    printf '%s\n' "${rows[@]}"
fi
exit $status
