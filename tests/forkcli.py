"""The command line run as a user runs it, without paying the interpreter's start each time.

A test that checks what a command says about bad input starts that command many times, and
each start imports Python, torch and the app again (1.5-2 s here) before the command reads its
first flag. ``run`` instead forks the command from a server process that has imported them once
(``multiprocessing``'s forkserver, which forks from a clean single-threaded process, never from
the test's own): the command still runs in its own process, from ``main()`` exactly as
``python -m app.train`` runs it, with its own stdout, stderr and exit status.

A forked command has the environment the server started with (the first ``run`` of the test
session), not the calling test's current ``os.environ``; torch and the app have read theirs at
import. A test that sets an environment variable for its command starts it with ``subprocess``.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_context = multiprocessing.get_context("forkserver")
# What every command imports before it parses a flag; Ray and the workers' imports are left to
# each command, as a first run would do them.
_context.set_forkserver_preload(["torch", "app.train", "app.tune", "app.builtin_tasks"])


def _command(module: str, args: list[str], cwd: str, stdout: str, stderr: str) -> None:
    os.chdir(cwd)
    for path, descriptor in ((stdout, 1), (stderr, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, descriptor)
        os.close(opened)
    sys.argv = [module, *args]
    # main() with no arguments is the process's own command line: it ends the process itself
    # (argparse's errors end it with SystemExit, as they would any command).
    sys.exit(importlib.import_module(module).main())


def run(module: str, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m module *args`` in ``cwd``: its exit status and what it printed."""
    with tempfile.TemporaryDirectory() as folder:
        stdout, stderr = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        process = _context.Process(target=_command,
                                   args=(module, list(args), str(cwd), stdout, stderr))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([module, *args], timeout)
        return subprocess.CompletedProcess(
            [module, *args], process.exitcode,
            Path(stdout).read_text(), Path(stderr).read_text(),
        )
