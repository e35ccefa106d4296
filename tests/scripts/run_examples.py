"""Runs example scripts as ``python examples/NAME.py`` would, each in a process forked from this one.

Run by `test_examples.py`:

    python tests/scripts/run_examples.py TIMEOUT_S WORKERS examples/exp.py examples/relu.py ...

Importing JAX and vjpkit is most of a small example's run, so this process
imports them once and forks a child per example, WORKERS at a time. The
child runs the script as ``__main__``: its directory first on ``sys.path``
in place of this script's, ``sys.argv`` its path, the working directory
unchanged, its own stdout and stderr, atexit handlers run at the end. No JAX
backend exists yet when a child is forked: the first JAX call in each child
starts its own, as in a fresh ``python``. Prints one JSON object: for each
path, its exit status (``None`` when it ran past TIMEOUT_S) and what it
printed.
"""

import atexit
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback

import jax  # noqa: F401 - imported once here, for every child
import numpy  # noqa: F401

# Internals on purpose: forking is only safe while no backend (and its threads) exists.
from jax._src import xla_bridge

import vjpkit  # noqa: F401


def run_as_main(path, out, err):
    """In the child: the script as ``python PATH`` runs it; never returns."""
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    status = 0
    try:
        sys.argv = [path]
        sys.path[0] = os.path.dirname(os.path.abspath(path))  # this script's directory until now
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        status = code or 0
    except BaseException:  # noqa: BLE001 - printed as Python would, with exit status 1
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()  # as the interpreter does on its way out
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def start(path):
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    pid = os.fork()
    if pid == 0:
        run_as_main(path, out, err)
    return pid, out, err, time.monotonic()


def finish(status, out, err):
    out.seek(0)
    err.seek(0)
    return {"returncode": status, "stdout": out.read(), "stderr": err.read()}


def main():
    timeout, workers, paths = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    assert not xla_bridge._backends, "a JAX backend exists before forking"
    sys.stdout.flush()
    sys.stderr.flush()
    waiting, running, results = list(paths), {}, {}
    while waiting or running:
        while waiting and len(running) < workers:
            path = waiting.pop(0)
            pid, out, err, started = start(path)
            running[pid] = (path, out, err, started)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            path, out, err, _ = running.pop(pid)
            results[path] = finish(os.waitstatus_to_exitcode(status), out, err)
            continue
        for pid, (path, out, err, started) in list(running.items()):
            if time.monotonic() - started > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del running[pid]
                results[path] = finish(None, out, err)
        time.sleep(0.05)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
