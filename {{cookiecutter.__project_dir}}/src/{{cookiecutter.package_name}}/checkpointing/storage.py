"""Where a run's checkpoints live: a local directory, or an object store (`s3://`, `gs://`).

`run.dir` is a path or a URL. A path is a `pathlib.Path`; a URL is an `ObjectPath`, which has
the few path operations checkpoints use (`/`, `name`, `parent`, `with_name`). Both go through
one small interface, `Storage`, with two implementations:

- `LocalStorage` (POSIX): a file is written to a temporary name, fsynced and renamed into
  place; a checkpoint is assembled in a staging directory and renamed into place whole.
- `ObjectStorage` (fsspec: s3fs, gcsfs): an object store has no rename, and an object appears
  whole or not at all. A checkpoint's files are written under the checkpoint's own name, and
  its `COMPLETE` marker last: that write is the commit point (checkpoint.py).

Credentials are never part of a URL (config validation refuses them): they come from the
environment only (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an
S3-compatible server, GOOGLE_APPLICATION_CREDENTIALS, ...), as the cloud SDKs read it, so
nothing the run writes (checkpoints, logs, metrics) can hold them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

#: URL scheme -> (fsspec implementation's package, the project's extra that installs it).
SCHEMES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}


def is_url(text: str) -> bool:
    return "://" in text


def url_problem(url: str) -> str | None:
    """What is wrong with `url` as a run directory, or None: an unknown scheme, credentials
    written into it, or the package its scheme needs missing."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        known = ", ".join(f"{scheme}://" for scheme in SCHEMES)
        return f"run.dir={url}: unknown scheme {parts.scheme}://; use a local path or {known}"
    if parts.username or parts.password or "@" in parts.netloc:
        return (
            f"run.dir={parts.scheme}://...@{parts.hostname}: credentials must not be written in "
            "run.dir (it is saved in every checkpoint and printed in the log). Give them in the "
            "environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "GOOGLE_APPLICATION_CREDENTIALS) and run.dir without them"
        )
    if not parts.netloc:
        return f"run.dir={url} names no bucket: use {parts.scheme}://BUCKET/PREFIX"
    package, extra = SCHEMES[parts.scheme]
    if importlib.util.find_spec(package) is None:
        return (
            f"run.dir={url} needs {package}, which is not installed: in the project, "
            f"pip install -e '.[{extra}]' (or pip install {package})"
        )
    return None


class ObjectPath:
    """A file or a prefix in an object store, named by its URL (`s3://bucket/run/...`)."""

    def __init__(self, url: str, local: Path | None = None) -> None:
        self.url = url.rstrip("/")
        #: For a run directory: its local part, where logs, metrics and the lock are kept
        #: (run.local_dir); copied with every checkpoint. Paths built from this one have none.
        self.local = local

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.url}/{name}")

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        return ObjectPath(self.url.rsplit("/", 1)[0])

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: ObjectPath) -> bool:
        return self.url < other.url


#: A local path or a location in an object store.
Location = Path | ObjectPath


def run_location(run_dir: str, local_dir: str = "") -> Location:
    """`run.dir` as a location: a Path, or an ObjectPath whose local part is `local_dir`
    (default: default_local_dir)."""
    if not is_url(run_dir):
        return Path(run_dir)
    return ObjectPath(run_dir, Path(local_dir or default_local_dir(run_dir)))


def default_local_dir(url: str) -> Path:
    """Where a run on an object store keeps its local files unless run.local_dir says:
    `runs/<scheme>/<bucket>/<prefix>`, relative to the working directory."""
    parts = urlsplit(url)
    return Path("runs", parts.scheme, parts.netloc, *parts.path.strip("/").split("/"))


def local_dir_of(run_dir: Location) -> Path:
    """The directory of a run's logs, metrics and lock: the run directory itself when it is
    local, its local part when it is in an object store."""
    if isinstance(run_dir, Path):
        return run_dir
    if run_dir.local is None:
        raise ValueError(f"{run_dir} is not a run directory: it has no local part")
    return run_dir.local


def storage_of(location: Location) -> Storage:
    """The storage `location` is in."""
    if isinstance(location, Path):
        return LOCAL
    return ObjectStorage.of(location)


class Storage(ABC):
    """The file operations of checkpoints and run files, on one kind of storage.

    `first`, where a method takes it, names the file whose presence makes a directory count
    (a checkpoint's COMPLETE): it is removed before the rest, so that a removal cut short
    leaves an incomplete directory, never a complete-looking one with files missing.
    """

    #: Whether a directory can be renamed into place in one step; without it, a checkpoint
    #: is written under its own name and counts once its marker is written.
    renames: bool

    @abstractmethod
    def is_file(self, path: Any) -> bool: ...

    @abstractmethod
    def exists(self, path: Any) -> bool:
        """Whether a file or directory (a prefix holding objects) is at `path`."""

    @abstractmethod
    def names(self, directory: Any) -> list[str]:
        """The names directly under `directory`; empty when there is none."""

    @abstractmethod
    def open_read(self, path: Any) -> BinaryIO: ...

    @abstractmethod
    def write(self, path: Any, fill: Callable[[BinaryIO], object]) -> None:
        """Write the whole file `path` with `fill(handle)`, in one step: a reader finds the
        previous file or the new one, never a part (durable before this returns)."""

    @abstractmethod
    def make_dirs(self, directory: Any) -> None: ...

    @abstractmethod
    def remove_tree(self, directory: Any, first: str | None = None) -> None:
        """Remove `directory` and everything in it; nothing when it does not exist."""

    @abstractmethod
    def move(self, source: Any, target: Any, first: str | None = None) -> None:
        """Move the directory `source` to the free name `target`."""

    @abstractmethod
    def publish(self, staging: Any, final: Any) -> None:
        """Put a complete staging directory in place of `final` (when `renames`)."""

    @abstractmethod
    def tree_size(self, directory: Any) -> int:
        """Bytes of the files in `directory`."""

    @abstractmethod
    def free_space(self, directory: Any) -> int | None:
        """Bytes free where `directory` is, or None where there is no such limit."""

    @abstractmethod
    def create(self, path: Any, data: bytes) -> bool:
        """Create the file `path` holding `data`, unless one is there (then False): of the
        processes racing to create one name, on any host, exactly one succeeds."""

    @abstractmethod
    def modified(self, path: Any) -> float:
        """When `path` was last written, in seconds since the epoch by the storage's own clock
        (hosts' clocks may differ); FileNotFoundError when it is not there."""

    @abstractmethod
    def touch(self, path: Any, data: bytes) -> None:
        """Make the storage's time now the modified time of `path`, a file holding `data`."""

    @abstractmethod
    def remove(self, path: Any) -> None:
        """Remove the file `path`; nothing when it is not there."""

    def read_bytes(self, path: Any) -> bytes:
        with self.open_read(path) as handle:
            return handle.read()

    def read_text(self, path: Any) -> str:
        return self.read_bytes(path).decode()

    def write_text(self, path: Any, text: str) -> None:
        self.write(path, lambda handle: handle.write(text.encode()))


class LocalStorage(Storage):
    """A POSIX file system: temporary names, fsync and rename."""

    renames = True

    def is_file(self, path: Path) -> bool:
        return path.is_file()

    def exists(self, path: Path) -> bool:
        return path.exists()

    def names(self, directory: Path) -> list[str]:
        if not directory.is_dir():
            return []
        return [entry.name for entry in directory.iterdir()]

    def open_read(self, path: Path) -> BinaryIO:
        return open(path, "rb")

    def write(self, path: Path, fill: Callable[[BinaryIO], object]) -> None:
        tmp = path.with_name(path.name + ".partial")
        with open(tmp, "wb") as handle:
            fill(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    def make_dirs(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)

    def remove_tree(self, directory: Path, first: str | None = None) -> None:
        if first is not None:
            (directory / first).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)

    def move(self, source: Path, target: Path, first: str | None = None) -> None:
        os.rename(source, target)

    def publish(self, staging: Path, final: Path) -> None:
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(final.parent)

    def tree_size(self, directory: Path) -> int:
        if not directory.is_dir():
            return 0
        return sum(entry.stat().st_size for entry in directory.iterdir() if entry.is_file())

    def free_space(self, directory: Path) -> int | None:
        return shutil.disk_usage(directory).free

    def create(self, path: Path, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return True

    def modified(self, path: Path) -> float:
        return path.stat().st_mtime

    def touch(self, path: Path, data: bytes) -> None:
        os.utime(path)

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)


class ObjectStorage(Storage):
    """An object store through fsspec: no rename; each object is written whole or not at all.

    Listings are never cached: another rank or node may have written since. Errors of the
    store's client (an unreachable endpoint, ...) are raised as OSError, as a file system's
    would be, so that they count as failures of the machine, never as damage.
    """

    renames = False

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    @classmethod
    def of(cls, location: ObjectPath) -> ObjectStorage:
        import fsspec  # an optional dependency: imported only for a run on an object store

        with _client_errors_as_os_errors():
            return cls(fsspec.filesystem(urlsplit(location.url).scheme, use_listings_cache=False))

    def is_file(self, path: ObjectPath) -> bool:
        with _client_errors_as_os_errors():
            return self.fs.isfile(path.url)

    def exists(self, path: ObjectPath) -> bool:
        with _client_errors_as_os_errors():
            return self.fs.exists(path.url)

    def names(self, directory: ObjectPath) -> list[str]:
        with _client_errors_as_os_errors():
            try:
                entries = self.fs.ls(directory.url, detail=False)
            except FileNotFoundError:
                return []
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def open_read(self, path: ObjectPath) -> BinaryIO:
        with _client_errors_as_os_errors():
            return self.fs.open(path.url, "rb")

    def read_bytes(self, path: ObjectPath) -> bytes:
        with _client_errors_as_os_errors():
            return self.fs.cat_file(path.url)

    def write(self, path: ObjectPath, fill: Callable[[BinaryIO], object]) -> None:
        # The object appears when the handle closes (a single or a multipart upload); a
        # process killed before then leaves nothing under this name.
        with _client_errors_as_os_errors(), self.fs.open(path.url, "wb") as handle:
            fill(handle)

    def make_dirs(self, directory: ObjectPath) -> None:
        """Nothing to do: a prefix exists once an object is written under it."""

    def remove_tree(self, directory: ObjectPath, first: str | None = None) -> None:
        with _client_errors_as_os_errors():
            if first is not None:
                with suppress(FileNotFoundError):
                    self.fs.rm_file((directory / first).url)
            with suppress(FileNotFoundError):
                self.fs.rm(directory.url, recursive=True)

    def move(self, source: ObjectPath, target: ObjectPath, first: str | None = None) -> None:
        """A copy of every object (server-side), then the removal of the source, `first` first:
        a move cut short leaves the source whole, or no longer complete."""
        with _client_errors_as_os_errors():
            for entry in self.fs.find(source.url):
                relative = entry.rstrip("/")[len(self.fs._strip_protocol(source.url)) + 1 :]
                self.fs.copy(entry, (target / relative).url)
        self.remove_tree(source, first)

    def publish(self, staging: ObjectPath, final: ObjectPath) -> None:
        """Nothing to do: a checkpoint on an object store is written under its own name."""

    def tree_size(self, directory: ObjectPath) -> int:
        with _client_errors_as_os_errors():
            try:
                return int(self.fs.du(directory.url))
            except FileNotFoundError:
                return 0

    def free_space(self, directory: ObjectPath) -> int | None:
        return None

    def create(self, path: ObjectPath, data: bytes) -> bool:
        """A conditional write (S3: `If-None-Match: *`): the store refuses it when the object
        exists. `data` must not be empty: s3fs writes an empty object unconditionally."""
        if not data:
            raise ValueError(f"{path}: an exclusive create needs some content")
        with _client_errors_as_os_errors():
            try:
                with self.fs.open(path.url, "xb") as handle:
                    handle.write(data)
            except FileExistsError:
                return False
        return True

    def modified(self, path: ObjectPath) -> float:
        """The object's LastModified, stamped by the store (to the second on S3)."""
        with _client_errors_as_os_errors():
            return self.fs.modified(path.url).timestamp()

    def touch(self, path: ObjectPath, data: bytes) -> None:
        """An object's time changes only when it is written: write `data` again."""
        self.write(path, lambda handle: handle.write(data))

    def remove(self, path: ObjectPath) -> None:
        with _client_errors_as_os_errors(), suppress(FileNotFoundError):
            self.fs.rm_file(path.url)

    def upload(self, local: Path, path: ObjectPath) -> None:
        with open(local, "rb") as source:
            self.write(path, lambda handle: shutil.copyfileobj(source, handle))


LOCAL = LocalStorage()
#: The packages whose exceptions are a store client's errors, not the program's.
_CLIENT_PACKAGES = {"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "requests"}


@contextmanager
def _client_errors_as_os_errors() -> Iterator[None]:
    try:
        yield
    except OSError:
        raise
    except Exception as error:
        if type(error).__module__.split(".")[0] not in _CLIENT_PACKAGES:
            raise
        raise OSError(f"{type(error).__name__}: {error}") from error


def fsync_dir(path: Path) -> None:
    """Make the renames inside `path` durable (a crash could otherwise undo them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
