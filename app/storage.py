"""Where runs live: storage URIs, the write probe, whether a run exists, and the run lock.

Everything goes through pyarrow's filesystem layer (what Ray Train writes with), so a local
folder and ``s3://bucket/prefix`` behave alike.
"""

from __future__ import annotations

import enum
import json
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path

import pyarrow
import pyarrow.fs

from app.config import RunConfig, UserError

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


def filesystem(uri: str, what: str = "storage") -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem of ``uri`` and the path in it (no trailing slash); UserError naming
    ``what`` the location was for when pyarrow cannot use it."""
    try:
        found, path = pyarrow.fs.FileSystem.from_uri(uri)
    except (pyarrow.ArrowInvalid, OSError) as error:
        raise UserError(f"cannot use {uri} as a {what} location: {error}") from None
    return found, path.rstrip("/")


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a folder or a URI (no doubled slashes)."""
    return "/".join([base.rstrip("/"), *(part.strip("/") for part in parts)])


def check_storage(storage_path: str) -> None:
    """Fail now, with the path in the message, if checkpoints could not be written there."""
    try:
        filesystem, path = pyarrow.fs.FileSystem.from_uri(storage_path)
        filesystem.create_dir(path, recursive=True)
        probe = join(path, ".write_probe")
        with filesystem.open_output_stream(probe) as stream:
            stream.write(b"ok")
        filesystem.delete_file(probe)
    except (OSError, pyarrow.ArrowException) as error:
        raise UserError(f"cannot write to storage path {storage_path}: {error}") from None


def run_folder(run: RunConfig) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem of the run's storage and the run's folder in it."""
    filesystem, path = pyarrow.fs.FileSystem.from_uri(run.storage_path)
    return filesystem, join(path, run.name)


def _snapshot_location(run: RunConfig) -> tuple[pyarrow.fs.FileSystem, str, str]:
    """The filesystem, the run's folder and Ray Train's record of its checkpoints (the
    snapshot) in that folder."""
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    filesystem, folder = run_folder(run)
    return filesystem, folder, join(folder, CHECKPOINT_MANAGER_SNAPSHOT_FILENAME)


class Snapshot(enum.Enum):
    """What Ray Train's record of a run's checkpoints says about the run."""

    MISSING = "missing"  # a new run
    READABLE = "readable"  # the run exists; Ray resumes it
    UNREADABLE = "unreadable"  # the run exists, but Ray would refuse to start it


def snapshot_state(run: RunConfig) -> Snapshot:
    """Whether the run exists and Ray Train can read its record (one read of the storage).

    Ray rewrites the snapshot in place after every checkpoint, so a driver killed during the
    write (or a full disk) leaves it empty or cut short; Ray then refuses to start the run
    (``CheckpointManagerInitializationError``) although every checkpoint is still there."""
    filesystem, _, snapshot = _snapshot_location(run)
    try:
        with filesystem.open_input_stream(snapshot) as stream:
            json.loads(stream.read())
    except FileNotFoundError:
        return Snapshot.MISSING
    except ValueError:  # not JSON (UnicodeDecodeError is one too)
        return Snapshot.UNREADABLE
    return Snapshot.READABLE


UNREADABLE_SUFFIX = ".unreadable"


def set_aside_snapshot(run: RunConfig) -> tuple[str, str | None]:
    """Renames the run's unreadable snapshot to ``<name>.unreadable`` (kept for a person to
    look at, out of Ray's way) and returns that new name and the URI of the run's newest
    checkpoint folder to resume from (None: it has none)."""
    filesystem, folder, snapshot = _snapshot_location(run)
    kept_as = snapshot + UNREADABLE_SUFFIX
    filesystem.move(snapshot, kept_as)
    newest = checkpoint_folders(filesystem, folder)
    return kept_as, join(run.storage_path, run.name, newest[0]) if newest else None


def checkpoint_folders(filesystem: pyarrow.fs.FileSystem, run_folder: str) -> list[str]:
    """The names of a run folder's checkpoint folders, newest first (``checkpoint.age_order``:
    a mid-epoch checkpoint comes before the end of its epoch)."""
    from app.checkpoint import age_order

    found = filesystem.get_file_info(pyarrow.fs.FileSelector(run_folder, allow_not_found=True))
    return sorted((info.base_name for info in found
                   if info.type == pyarrow.fs.FileType.Directory
                   and age_order(info.base_name) is not None), key=age_order, reverse=True)


def latest_settings(run: RunConfig) -> dict:
    """The settings recorded in the run's newest checkpoint ({} when there is none, or it
    predates them); what a rerun of the run is checked against before any worker starts."""
    from app.checkpoint import SETTINGS_FILE

    filesystem, folder = run_folder(run)
    for name in checkpoint_folders(filesystem, folder):
        try:
            with filesystem.open_input_stream(join(folder, name, SETTINGS_FILE)) as stream:
                return json.loads(stream.read())
        except (OSError, ValueError):
            continue  # cut short, or written before settings were: try an older one
    return {}


def make_private(uri: str) -> None:
    """Create the folder ``uri`` readable and writable by its owner only, where the storage has
    permissions (a local folder; object stores have policies instead)."""
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    filesystem.create_dir(path, recursive=True)
    if isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        os.chmod(path, 0o700)


class RunLock:
    """Keeps a second driver off a run while one trains it: ``<run>/.lock``.

    Holds who has the run (host, pid) and a heartbeat refreshed every ``refresh_s``. A lock is
    stale, and is taken over, when its holder is a dead process on this host or its heartbeat is
    older than ``stale_s`` (a crashed driver elsewhere); a clean exit removes it.
    """

    FILE = ".lock"

    def __init__(self, run: RunConfig, refresh_s: float = 10.0, stale_s: float = 60.0):
        self.filesystem, self.folder = run_folder(run)
        self.path = join(self.folder, self.FILE)
        self.run = run
        self.refresh_s = refresh_s
        self.stale_s = stale_s
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "token": self._token, "heartbeat": time.time()}).encode()

    def _holder(self) -> dict | None:
        try:
            with self.filesystem.open_input_stream(self.path) as stream:
                return json.loads(stream.read())
        except (OSError, ValueError, pyarrow.ArrowException):
            return None

    def _is_stale(self, holder: dict) -> bool:
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder.get("pid", -1)), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, ValueError, OverflowError):
                pass
        return time.time() - float(holder.get("heartbeat", 0)) > self.stale_s

    def _write(self) -> None:
        with self.filesystem.open_output_stream(self.path) as stream:
            stream.write(self._record())

    def acquire(self) -> None:
        try:
            # The run's checkpoints and results are the owner's alone.
            make_private(join(self.run.storage_path, self.run.name))
            if isinstance(self.filesystem, pyarrow.fs.LocalFileSystem):
                self._acquire_local()
            else:
                holder = self._holder()
                if holder is not None and not self._is_stale(holder):
                    self._refuse(holder)
                self._write()
        except (OSError, pyarrow.ArrowException) as error:
            raise UserError(f"cannot lock run {self.run.name!r} in {self.run.storage_path}: "
                            f"{error}") from None
        self._thread = threading.Thread(target=self._refresh, name="run-lock", daemon=True)
        self._thread.start()

    def _acquire_local(self) -> None:
        for _ in range(3):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and not self._is_stale(holder):
                    self._refuse(holder)
                Path(self.path).unlink(missing_ok=True)  # stale: take it over
                continue
            with os.fdopen(descriptor, "wb") as stream:
                stream.write(self._record())
            return
        raise OSError(f"{self.path} keeps reappearing")

    def _refuse(self, holder: dict) -> None:
        since = time.time() - float(holder.get("heartbeat", 0))
        raise UserError(
            f"run {self.run.name!r} is being trained by another command (pid {holder.get('pid')} "
            f"on {holder.get('host')}, alive {since:.0f} s ago): wait for it to end, or use "
            f"another --name (a crashed run's lock expires after {self.stale_s:g} s)"
        )

    def _refresh(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                holder = self._holder()
                if holder is None or holder.get("token") == self._token:
                    self._write()
            except (OSError, pyarrow.ArrowException):
                pass  # best effort: a missed heartbeat only makes the lock look older

    def release(self) -> None:
        self._stop.set()
        try:
            holder = self._holder()
            if holder is not None and holder.get("token") == self._token:
                self.filesystem.delete_file(self.path)
        except (OSError, pyarrow.ArrowException):
            pass  # the lock then goes stale on its own

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
