"""Which files a living process still owns: a lock the kernel drops when its holder dies.

A Space leaves things behind when it is killed: a save between its two renames (saving.py),
package folders the AOTI loader extracted into /tmp (runner.py), result images (results.py). The
next process must tell a leftover of a dead process from the work of a living one. A process id
cannot tell: in a container the app is often PID 1 at every start, so a dead process's PID is the
living one's. So the owner holds an exclusive `flock` on a lock file for as long as the work lasts,
and the kernel releases it when the owner's last descriptor closes, which a kill does too. Whoever
can take the lock knows no living process holds it (`held`).

`flock` locks belong to an open file description: a process that forks shares its locks with the
child (a ZeroGPU worker keeps its parent's), and a second `open` of the same file in the holder
itself conflicts with the first, so the holder's own work counts as held too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

# Locks held for this process's lifetime (`hold`): path -> descriptor.
_HELD: dict[str, int] = {}


def hold(path: str | os.PathLike) -> None:
    """Take the exclusive lock on `path` (created if missing) until this process ends.

    Raises:
        BlockingIOError: another living process holds it.
        OSError: the lock file cannot be created.
    """
    key = os.fspath(path)
    if key in _HELD:
        return
    handle = os.open(key, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(handle)
        raise
    _HELD[key] = handle


@contextlib.contextmanager
def holding(path: str | os.PathLike, wait: bool = True) -> Iterator[bool]:
    """Hold the exclusive lock on `path` (created if missing) inside the block; yields whether it
    does. `wait`: wait while another process holds it (then it always does); else yield False at
    once. The lock file stays.

    Raises:
        OSError: the lock file cannot be created (a read-only folder).
    """
    handle = os.open(os.fspath(path), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(handle)  # releases the lock


def held(path: str | os.PathLike) -> bool:
    """Whether a living process (this one included) holds the lock on `path`; False where there is
    no such file."""
    try:
        handle = os.open(os.fspath(path), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(handle)
    return False
