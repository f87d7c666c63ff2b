"""One job per run directory: `<run.dir>/LOCK`, taken by rank 0 before anything is written there.

Two jobs in one run directory (a job submitted twice, a relaunch beside workers that train on)
would write the same checkpoints, append to the same metrics and prune each other's saves. The
second job is refused instead (exit status 4 on every rank), with a message naming the first.

The lock works on shared file systems (NFS, Lustre, GPFS), where flock() may do nothing or lock
one host only, and on object stores (run.dir=s3://...), where nodes share no file system at all.
It is a file created in one step: a complete temporary file hard-linked to the name `LOCK` (the
method open(2) gives for NFS), or an exclusive create where the file system has no hard links
and on an object store (a conditional write, which the store refuses when the object exists).
Its file operations go through storage.py. It names its holder: host, pid, job id (Slurm's,
else torchrun's run id), start time. A thread of the holder touches it (on an object store:
writes it again) every HEARTBEAT_S seconds; it is released on every way out of the job but a
kill.

A lock is a dead job's, and is taken over, when its heartbeat is older than STALE_BEATS
periods, or at once when its holder ran on this machine (same boot, same pid namespace) and
that process is gone. A live job's lock is never taken. Ages are read on the storage's own
clock (the time it stamps on a file this job has just touched: an object's LastModified), so
hosts need not agree on the time. A takeover begins with an exclusive create of
`LOCK.takeover.<the dead lock's token>`: of the jobs racing for one dead lock, only the one that
creates it replaces the lock, so exactly one of them wins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from ..cluster.distributed import DistEnv, all_ranks_agree
from .storage import Location, Storage, storage_of

log = logging.getLogger(__name__)

#: The exit status of a job refused because another job holds its run directory.
EXIT_RUN_DIR_BUSY = 4
LOCK_FILE = "LOCK"
#: Seconds between two heartbeats of the holder.
HEARTBEAT_S = 10.0
#: Heartbeats missed before a lock counts as a dead job's: far above a stall of the file system.
STALE_BEATS = 6
#: Seconds before looking again after another job's takeover of the same dead lock.
_RETRY_S = 0.05


class RunDirBusyError(RuntimeError):
    """This job cannot own the run directory: another job, alive, holds it, or its lock is out
    of reach (an object store's endpoint, credentials)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what its file records."""

    host: str
    pid: int
    #: Slurm's job id, else torchrun's run id; None when started by hand.
    job: str | None
    #: (Slurm requeues, torchrun restarts) of the job: a later attempt replaces an earlier one.
    attempt: tuple[int, int]
    started: str
    heartbeat_s: float
    #: Boot and pid namespace: where `pid` names the same process; None where unknown.
    machine: str | None
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def of_this_process(cls, heartbeat_s: float, environ: Mapping[str, str] = os.environ) -> Holder:
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            job=environ.get("SLURM_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or None,
            attempt=(
                int(environ.get("SLURM_RESTART_COUNT", "0")),
                int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            ),
            started=datetime.now().astimezone().isoformat(timespec="seconds"),
            heartbeat_s=heartbeat_s,
            machine=_machine(),
        )

    @classmethod
    def parse(cls, data: bytes) -> Holder:
        """The holder a lock file names; an unreadable one (edited by hand, another version)
        still counts as held, by someone unknown, until its heartbeat is old."""
        try:
            fields = json.loads(data)
            return cls(**{**fields, "attempt": tuple(fields["attempt"])})
        except (ValueError, TypeError, KeyError):
            unknown = "unknown (unreadable lock file)"
            token = hashlib.sha256(data).hexdigest()[:32]
            return cls(unknown, 0, None, (0, 0), unknown, HEARTBEAT_S, None, token)

    def describe(self, age_s: float) -> str:
        return (
            f"host {self.host}, pid {self.pid}, job {self.job or 'none'}, started {self.started}, "
            f"last heartbeat {age_s:.0f} s ago"
        )

    @property
    def stale_after_s(self) -> float:
        return STALE_BEATS * self.heartbeat_s


class RunLock:
    """The lock of one run directory, as held (or wanted) by this process."""

    def __init__(self, run_dir: Location, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self.store: Storage = storage_of(run_dir)
        self.me = Holder.of_this_process(heartbeat_s)
        #: What the lock file of this job holds.
        self.record = (json.dumps(asdict(self.me)) + "\n").encode()
        #: The dead job whose lock this one replaced, for the log.
        self.replaced: tuple[Holder, float] | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise RunDirBusyError naming the job that holds it."""
        self.store.make_dirs(self.run_dir)
        candidate = self._write_candidate()
        waiting_since: float | None = None
        try:
            while not self._link(candidate):
                found = _read(self.store, self.path)
                if found is None:
                    continue  # released in the meantime: try again
                holder, stamped = found
                age = self._storage_now(candidate) - stamped
                if self._is_dead(holder, age):
                    if self._take_over(holder, age, candidate):
                        break
                    time.sleep(_RETRY_S)
                    continue
                # torchrun restarted this job (or Slurm requeued it): its previous rank 0 is
                # gone, and its lock is taken over once its heartbeat is old. A holder whose
                # heartbeat goes on meanwhile is alive after all.
                waiting_since = waiting_since or time.monotonic()
                waited = time.monotonic() - waiting_since
                if not self._is_earlier_attempt(holder) or waited > 2 * holder.stale_after_s:
                    raise RunDirBusyError(self._refusal(holder, age))
                time.sleep(min(1.0, holder.heartbeat_s / 2))
        finally:
            self.store.remove(candidate)
        self._heartbeat = threading.Thread(target=self._beat, name="run-dir-lock", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this job's."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
            try:
                found = _read(self.store, self.path)
                if found is not None and found[0].token == self.me.token:
                    self.store.remove(self.path)
            except OSError as error:  # the job's own outcome stands; the lock goes stale
                log.warning(
                    "cannot release %s (%s): the next launch takes it over once its heartbeat "
                    "is %.0f s old",
                    self.path,
                    error,
                    self.me.stale_after_s,
                )

    def _write_candidate(self) -> Location:
        """A complete file of this job's record beside the lock: linked to the lock on a file
        system, and on any storage the file whose time stamp tells the storage's time."""
        candidate = self.run_dir / f".{LOCK_FILE}.{self.me.token}"
        self.store.write(candidate, lambda handle: handle.write(self.record))
        return candidate

    def _link(self, candidate: Location) -> bool:
        """Create the lock from `candidate` in one step; False when a lock is there."""
        if not isinstance(self.path, Path):
            return self.store.create(self.path, self.record)  # an object appears whole
        try:
            os.link(candidate, self.path)
        except FileExistsError:
            return False
        except OSError:
            # NFS: the reply of a link that worked may be lost, and the retry fail.
            if os.stat(candidate).st_nlink == 2:
                return True
            return self.store.create(self.path, self.record)  # no hard links here
        return True

    def _is_dead(self, holder: Holder, age: float) -> bool:
        if age > holder.stale_after_s:
            return True
        same_machine = holder.machine is not None and holder.machine == self.me.machine
        return same_machine and not _process_exists(holder.pid)

    def _is_earlier_attempt(self, holder: Holder) -> bool:
        same_job = holder.job is not None and holder.job == self.me.job
        return same_job and holder.attempt < self.me.attempt

    def _take_over(self, dead: Holder, age: float, candidate: Location) -> bool:
        """Replace `dead`'s lock with this job's; False when another job is, or was, faster.

        Only the job that creates the takeover file of `dead` may move its lock aside: no
        other job can then replace the lock while this one does.
        """
        claim = self.path.with_name(f"{LOCK_FILE}.takeover.{dead.token}")
        if not self.store.create(claim, self.record):
            # Another job takes it over now; or died doing so, long ago: then clear its claim.
            found = _read(self.store, claim)
            if found is not None and self._storage_now(candidate) - found[1] > dead.stale_after_s:
                self.store.remove(claim)
            return False
        try:
            found = _read(self.store, self.path)
            if found is None or found[0].token != dead.token:
                return False  # replaced or released since it was read
            self.store.remove(self.path)
            if not self._link(candidate):
                return False  # a job that found no lock at all took it meanwhile
        finally:
            self.store.remove(claim)
        self.replaced = (dead, age)
        return True

    def _refusal(self, holder: Holder, age: float) -> str:
        return (
            f"{self.run_dir} is in use by another job: {holder.describe(age)} (recorded in "
            f"{self.path}). Two jobs in one run directory would overwrite each other's "
            "checkpoints and metrics. Wait for that job to end or stop it (SIGTERM: it saves a "
            f"checkpoint), or use another run.dir. A lock without a heartbeat for "
            f"{holder.stale_after_s:.0f} s is a dead job's and is taken over by the next "
            f"launch; remove {self.path} by hand only when you are sure that job is gone."
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.me.heartbeat_s):
            try:
                self._refresh()
            except OSError as error:  # a file system hiccup: the next beat tries again
                log.warning("cannot refresh the heartbeat of %s: %s", self.path, error)

    def _refresh(self) -> None:
        """Touch the lock; take it back if it was removed; end the process if another job
        took it over (this one was silent for STALE_BEATS heartbeats, e.g. stopped)."""
        found = _read(self.store, self.path)
        if found is None:
            log.warning("%s was removed while this job held it: taking it again", self.path)
            candidate = self._write_candidate()
            try:
                self._link(candidate)
            finally:
                self.store.remove(candidate)
            found = _read(self.store, self.path)
        if found is not None and found[0].token != self.me.token:
            log.error(
                "another job took %s over: %s. This job stops now, writing nothing more; that "
                "job goes on from the newest checkpoint",
                self.run_dir,
                found[0].describe(0),
            )
            logging.shutdown()
            os._exit(EXIT_RUN_DIR_BUSY)
        self.store.touch(self.path, self.record)

    def _storage_now(self, candidate: Location) -> float:
        """The storage's time now: touch this job's candidate file and read its stamp."""
        self.store.touch(candidate, self.record)
        return self.store.modified(candidate)


@contextmanager
def owned_run_dir(run_dir: Location, env: DistEnv) -> Iterator[RunLock | None]:
    """Rank 0 takes the run directory's lock for the block; every rank learns whether it did.

    A collective, after the process group has started (a wait for a previous attempt of this
    job may outlast its start-up timeout) and before anything is written in the run directory.
    A refused job raises RunDirBusyError on every rank. Yields rank 0's lock, None elsewhere.
    """
    lock = RunLock(run_dir) if env.is_main else None
    refusal: RunDirBusyError | None = None
    try:
        if lock is not None:
            try:
                lock.acquire()
            except RunDirBusyError as error:
                refusal = error
            except OSError as error:
                refusal = RunDirBusyError(
                    f"cannot take the lock {lock.path}: {error}. Check that the run directory "
                    "can be written (for an object store: the endpoint, the network and the "
                    "credentials in the environment), then launch again"
                )
        if not all_ranks_agree(refusal is None):
            raise refusal or RunDirBusyError(
                f"another job holds {run_dir / LOCK_FILE}, or it is out of reach; rank 0's "
                "message names it"
            )
        yield lock
    finally:
        if lock is not None:
            lock.release()


def _read(store: Storage, path: Location) -> tuple[Holder, float] | None:
    """The holder a lock file names and its modification time; None when there is no lock.

    The content is read first (opening the file makes an NFS client fetch its attributes
    afresh: close-to-open), its time after: a lock replaced in between looks younger than it
    is, never older, so a live job's lock is never judged dead by a mismatch.
    """
    try:
        data = store.read_bytes(path)
        return Holder.parse(data), store.modified(path)
    except FileNotFoundError:
        return None


def _machine() -> str | None:
    """This boot of this machine, and this pid namespace: where a pid names the same process."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{namespace}"


def _process_exists(pid: int) -> bool:
    if pid <= 0:
        return True  # unknown: the heartbeat decides
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
