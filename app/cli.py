"""What the command lines share: parsing conventions, exit statuses, and turning errors into one
line on stderr."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from app.config import UserError
from app.console import Console

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the empty ones (flags, and values derived when unset)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the whole usage block
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def storage_uri(path: str) -> str:
    """A URI as given; a local path made absolute (Ray needs absolute storage paths)."""
    return path if "://" in path else str(Path(path).expanduser().resolve())


def run_main(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace, Console], int],
    argv: list[str] | None,
    interrupted: str,
) -> int:
    """Parse, run, and map a UserError to one stderr line and exit 2, Ctrl-C to exit 130."""
    args = parser.parse_args(argv)
    try:
        return run(args, Console())
    except UserError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"interrupted: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
