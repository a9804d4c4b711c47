"""What the command lines share: parsing conventions, exit statuses, and turning errors into one
line on stderr."""

from __future__ import annotations

import argparse
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from app.config import UserError
from app.console import Console

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


class Terminated(BaseException):
    """SIGTERM arrived (``ray job stop``, Kubernetes, Slurm, a spot shutdown): stop like Ctrl-C.

    A BaseException, as KeyboardInterrupt is, so no ``except Exception`` on the way swallows it.
    """


def _terminate(signum, frame):
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


STORAGE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "abfs", "abfss", "file")
"""URI schemes of the filesystems pyarrow (and so Ray Train) writes to."""
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(//)?(.*)$", re.DOTALL)


def storage_uri(path: str, flag: str = "--storage-path") -> str:
    """A URI as given; a local path made absolute (Ray needs absolute storage paths).

    Refuses what would silently land somewhere else: ``s3:/bucket`` (one slash) would be a
    local folder named ``s3:``, and an unknown scheme a local folder too.
    """
    if not path.strip():
        raise UserError(f"{flag} must not be empty")
    match = _SCHEME.match(path)
    if match is None:
        return str(Path(path).expanduser().resolve())
    scheme, slashes, rest = match.groups()
    if scheme.lower() not in STORAGE_SCHEMES:
        raise UserError(
            f"{flag} {path!r}: unknown scheme {scheme + ':'!r}; use a local folder or one of "
            + ", ".join(f"{known}://" for known in STORAGE_SCHEMES)
        )
    if not slashes:
        raise UserError(f"{flag} {path!r} is not a URI: write it as {scheme}://{rest.lstrip('/')}")
    if not rest.strip("/") and scheme.lower() != "file":
        raise UserError(f"{flag} {path!r} names no bucket: write it as {scheme}://BUCKET/PREFIX")
    return path


def run_main(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace, Console], int],
    argv: list[str] | None,
    interrupted: str,
) -> int:
    """Parse, run, and map a UserError to one stderr line and exit 2, Ctrl-C to exit 130 and
    SIGTERM to exit 143 (each with one line saying what was kept)."""
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args, Console())
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Terminated:
        print(f"terminated: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_TERMINATED
