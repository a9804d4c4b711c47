"""What the command lines share: parsing conventions, exit statuses, and turning errors into one
line on stderr."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

from app.config import UserError
from app.console import Console

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (``ray job stop``, Kubernetes, Slurm, a spot shutdown): stop like Ctrl-C.

    A KeyboardInterrupt, so every layer on the way treats it as Ctrl-C: Ray's waits re-raise
    it (another type raised from a signal handler inside Ray's C code turns into SystemError),
    and Ray Tune stops its sweep gracefully and returns, which is why ``was_terminated`` exists.
    """


_terminated = threading.Event()


def was_terminated() -> bool:
    """Whether SIGTERM arrived, even if a layer (Ray Tune) turned it into a graceful return."""
    return _terminated.is_set()


RAY_NOISE = "A worker died or was killed while executing a task"
"""Ray's driver messages that the app's console replaces with its own line."""


def _terminate(signum, frame):
    _terminated.set()
    raise Terminated()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones (flags, and values derived when unset)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the whole usage block
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def _end_process(code: int) -> None:
    """Exit now, skipping the interpreter's teardown: with Ray's threads still around (a Train
    run ended by the watchdog leaves its fit thread inside Ray's C++ client) that teardown can
    crash with SIGSEGV after the run's last line was printed. Everything worth keeping is
    written and Ray is disconnected by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace, Console], int],
    argv: list[str] | None,
    interrupted: str,
) -> int:
    """Parse, run, and map a UserError to one stderr line and exit 2, Ctrl-C to exit 130 and
    SIGTERM to exit 143 (each with one line saying what was kept).

    ``argv`` None means these are the process's own arguments (the command line, not a caller
    in Python): the process then ends here, see ``_end_process``.
    """
    code = _run_main(parser, run, argv, interrupted)
    if argv is None:
        _end_process(code)
    return code


def _run_main(parser, run, argv, interrupted) -> int:
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    if not getattr(args, "verbose", False):
        # Ray prints its own paragraph when a worker dies (through its error channel, which
        # log_to_driver does not silence); the console says it in one line instead. Read by Ray
        # when it is first imported, which is after this.
        os.environ.setdefault("RAY_DEDUP_LOGS_SKIP_REGEX", RAY_NOISE)
    try:
        return run(args, Console())
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except BrokenPipeError:  # the reader went away (`| head`): nothing is left to say
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # no real file descriptor (a test's stream)
            pass
        return 0
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (Terminated)
        if was_terminated():
            print(f"terminated: {interrupted}", file=sys.stderr, flush=True)
            return EXIT_TERMINATED
        print(f"interrupted: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
