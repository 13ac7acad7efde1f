"""Compiled packages saved to a folder and pushed to the Hub.

Layout (what `spaces.aoti_blocks_load(transformer, repo_id, variant=...)` reads):

    DIR/config.<variant>.json                 kernels to load first, the fingerprint, per-class metadata
    DIR/<BlockClass>.<variant>/package.pt2    one weights-less AOTInductor package per block class

The variant names the graph-changing choices, e.g. `fa3-fp8row-512-1536`; the fingerprint records
what a package is valid for (fingerprint.py), which loading.py checks before any package reaches the
native loader. A save writes the new set beside the folder and swaps it in with two renames, so no
reader sees a half-written set. Neither weights nor tokens are written. (AOTInductor itself embeds
its build command, with the build machine's include paths, in each package's sources and debug info.)
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi

from aot import locks
from aot.compiled import Compiled
from aot.destinations import check_push_target, check_save_target, hub_repo
from aot.fa3 import FA3_KERNEL_VERSION
from aot.fingerprint import variant
from aot.options import Options

log = logging.getLogger("packages")

PACKAGE = "package.pt2"


def save_packages(compiled: Compiled, directory: str | os.PathLike) -> Path:
    """Write `compiled` as one variant into `directory`, atomically; other variants there are kept.

    Returns:
        The path of the variant's config file.

    Raises:
        RuntimeError: `directory` cannot be replaced (`check_save_target`); nothing was written.
        OSError: writing failed; `directory` is as it was and nothing is left beside it.
    """
    check_save_target(directory)
    directory = Path(directory).resolve()
    name = variant(compiled.fingerprint)
    config = {
        "kernels": _kernels(compiled.fa3_kernel),
        "fingerprint": compiled.fingerprint,
        "decisions": [[d.name, d.value, d.reason] for d in compiled.decisions],
        "fp8_granularity": compiled.fp8_granularity,
        "blocks": {block: package.metadata() for block, package in compiled.packages.items()},
    }

    def fill(staging: Path) -> None:
        for block, package in compiled.packages.items():
            (staging / f"{block}.{name}").mkdir()
            _write(staging / f"{block}.{name}" / PACKAGE, package.package)
        _write(staging / f"config.{name}.json", json.dumps(config, indent=1).encode())

    _swap(directory, fill)
    log.info("saved %d packages (variant %s) to %s", len(compiled.packages), name, directory)
    return directory / f"config.{name}.json"


def save_and_push(compiled: Compiled, options: Options) -> str:
    """Save `compiled` into `options.save` (`save_packages`) and, with `options.push`, publish that
    folder (`push_packages`); returns where they went, in one line.

    Raises:
        RuntimeError, OSError: the save or the push failed (see those); the folder is as it was.
    """
    where = str(save_packages(compiled, options.save).parent)
    if options.push:
        where += f"; pushed to {push_packages(options.save, options.push, options.model)}"
    return where


def _swap(directory: Path, fill: Callable[[Path], None]) -> None:
    """Replace `directory` by a new version of it, so that no reader sees a half-written set.

    `fill(staging)` writes the new entries into a staging folder beside `directory`; entries of the
    old folder that `fill` did not write are carried over as hard links (never written through;
    a symbolic link stays a link, which the loader refuses). Two renames then swap the folders.
    A failure leaves the old folder as it was and removes the staging folder; a failed second
    rename puts the old folder back. A kill before the renames leaves the old folder as it was;
    one between them leaves it as `.<name>.old-*`, which `_tidy` puts back.

    The whole save holds `.<name>.lock` beside `directory` (`locks.holding`; a second save waits
    for the first), so leftovers found while it is held are a dead save's, whatever its PID.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    with locks.holding(_save_lock(directory)):
        _tidy(directory)
        _swap_held(directory, fill)


def _save_lock(directory: Path) -> Path:
    """The lock a save of `directory` holds while it runs: `.<name>.lock` beside it."""
    return directory.with_name(f".{directory.name}.lock")


def _swap_held(directory: Path, fill: Callable[[Path], None]) -> None:
    """`_swap`'s work, its lock held."""
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.staging-", dir=directory.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    previous = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        fill(staging)
        if directory.is_dir():
            for entry in directory.iterdir():
                if not os.path.lexists(staging / entry.name):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.copytree(entry, staging / entry.name, symlinks=True, copy_function=os.link)
                    else:
                        os.link(entry, staging / entry.name, follow_symlinks=False)
        if directory.exists():
            os.rename(directory, previous)
        try:
            os.rename(staging, directory)
        except BaseException:
            if previous.exists():
                os.rename(previous, directory)
            raise
    except BaseException:
        _remove(staging)
        raise
    _remove(previous)


def tidy_unless_saving(directory: Path) -> None:
    """`_tidy(directory)` before a load, unless a save of it is under way in a living process (its
    lock is held: then what lies beside it is that save's). A folder where the lock file cannot be
    made (read-only) is not tidied: nothing there could be renamed or removed anyway."""
    try:
        with locks.holding(_save_lock(directory), wait=False) as mine:
            if mine:
                _tidy(directory)
    except OSError as exc:
        log.info("not tidying beside %s: %s", directory, exc)


def _tidy(directory: Path) -> None:
    """Repair and clean what interrupted saves left beside `directory`; its caller holds the save
    lock (`_swap`, `tidy_unless_saving`), so no save of it is under way.

    A save names its folders `.<name>.staging-*` and `.<name>.old-*`. If `directory` is missing,
    the newest old copy is renamed back (a save stopped between its two renames); the other
    leftovers are deleted, read-only ones included. Failures are logged, not raised: a load from a
    read-only place still works.
    """

    def left(kind: str) -> list[Path]:
        found = directory.parent.glob(glob.escape(f".{directory.name}.{kind}-") + "*")
        return sorted(found, key=lambda p: p.lstat().st_mtime)

    try:
        olds = [p for p in left("old") if p.is_dir() and not p.is_symlink()]
        if olds and not os.path.lexists(directory):
            os.rename(olds.pop(), directory)
            log.warning("%s was missing after an interrupted save; restored the previous packages", directory)
        for leftover in left("old") + left("staging"):
            if _remove(leftover):
                log.info("removed %s, left by an interrupted save", leftover)
    except OSError as exc:
        log.warning("cannot tidy up what interrupted saves left beside %s: %s", directory, exc)


def _remove(path: Path) -> bool:
    """Delete `path`, a leftover of ours: read-only folders are made writable first; a link or a
    file is unlinked, never followed. Returns whether it is gone, so that a caller reports only a
    removal that happened. A failure is logged (the folder stays; nothing depends on it)."""
    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
            return True
        for root, _, _ in os.walk(path):  # top-down: each folder is writable before its entries go
            os.chmod(root, 0o700)
        shutil.rmtree(path)
        return True
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
        return False


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _kernels(fa3_kernel: str | None) -> list[dict[str, Any]]:
    """Kernels a loader fetches first, in `spaces.aoti_blocks_load`'s format (`get_kernel` kwargs)."""
    if fa3_kernel is None or "/" not in fa3_kernel:
        return []
    return [{"repo_id": fa3_kernel, "version": FA3_KERNEL_VERSION}]


def push_packages(directory: str | os.PathLike, target: str, model: str | None = None) -> str:
    """Publish a saved folder to a Hub repo id (one commit, naming `model` where given; token from
    HF_TOKEN) or a local folder.

    A local target is updated with `save_packages`'s atomic swap. Returns where the packages went
    (for the Hub, with the `owner/name@<commit>` to load them pinned).

    Raises:
        RuntimeError: see `check_push_target`.
    """
    directory = Path(directory)
    check_push_target(target)
    repo = hub_repo(target)
    if repo is None:
        destination = Path(target).resolve()
        _swap(destination, lambda staging: shutil.copytree(directory, staging, dirs_exist_ok=True))
        return str(destination)
    api = HfApi()
    api.create_repo(repo.repo_id, exist_ok=True)
    message = f"Add AoT-compiled blocks of {model}" if model else "Add AoT-compiled blocks"
    commit = api.upload_folder(repo_id=repo.repo_id, folder_path=str(directory), commit_message=message)
    return f"https://huggingface.co/{repo.repo_id} (load it pinned: --load {repo.repo_id}@{commit.oid})"
