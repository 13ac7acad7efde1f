"""Result files: each image a PNG of its own, written atomically, none kept for ever.

A request's image is written into this process's own folder under gradio's cache
(`<GRADIO_TEMP_DIR or /tmp/gradio>/aot-results/run-*`), first under a temporary name, then renamed:
a client never downloads half a file, and a kill mid-write leaves no truncated PNG under a result's
name. The folder is one of gradio's static paths, so gradio serves each file as it is and keeps no
record of it; a thread of this module deletes results older than `--results-max-age`. (gradio's
own `delete_cache` sweep, which `delete_cache` below sets for the uploads, stopped deleting after
about 1,000 requests of a soak run, with no error logged, and the files it tracks are never
forgotten once something else deletes them: see BENCHMARKS.md, "Soak".)

What a process that died left (a kill, a crash, a restart of the Space) goes when the next one
starts: each process holds the lock of its folder while it lives (`locks.hold`), so a folder whose
lock nobody holds is an earlier run's, whatever its PID.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path

import gradio as gr
from gradio.utils import get_upload_folder
from PIL import Image

from aot import locks

ROOT_NAME = "aot-results"
LOCK_NAME = ".lock"
# A run folder still without its lock file is being created: it is left alone for this long.
CREATING_S = 60
# The sweeps run every `max_age` seconds, but at least this often.
SWEEP_EVERY_S = 60
log = logging.getLogger("results")


def delete_cache(max_age_s: int) -> tuple[int, int]:
    """gradio's `delete_cache=(frequency, age)` for the uploads it keeps: older than `max_age_s`
    seconds, deleted at the next sweep, which runs every `max_age_s` seconds, at most every
    `SWEEP_EVERY_S`."""
    return min(max_age_s, SWEEP_EVERY_S), max_age_s


class Results:
    """This process's folder of result files (`folder`), whose lock it holds while it lives.

    Making one removes the folders of earlier runs (`swept`: their processes are gone), makes the
    folder a static path of gradio's, and starts the thread that deletes results older than
    `max_age_s` every `max_age_s` seconds, at most every `SWEEP_EVERY_S`.

    Args:
        max_age_s: how long a result is kept, in seconds (`--results-max-age`).
        cache: the folder to keep results under (default: gradio's cache folder).

    Raises:
        OSError: the folder cannot be made or locked (a read-only or full disk).
    """

    def __init__(self, max_age_s: int, cache: str | os.PathLike | None = None):
        root = Path(cache or get_upload_folder()) / ROOT_NAME
        root.mkdir(parents=True, exist_ok=True)
        self.swept = sweep(root)
        self.folder = Path(tempfile.mkdtemp(prefix="run-", dir=root))
        locks.hold(self.folder / LOCK_NAME)
        gr.set_static_paths([self.folder])  # served as they are: gradio neither copies nor tracks them
        self.max_age_s = max_age_s
        threading.Thread(target=self._sweep_forever, name="results-sweep", daemon=True).start()

    def delete_older_than(self, age_s: float) -> int:
        """Delete the results written more than `age_s` seconds ago; returns how many."""
        cutoff, deleted = time.time() - age_s, 0
        for path in self.folder.glob("seed-*.png"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    deleted += 1
            except FileNotFoundError:
                continue
        return deleted

    def _sweep_forever(self) -> None:
        while True:
            time.sleep(min(self.max_age_s, SWEEP_EVERY_S))
            try:
                self.delete_older_than(self.max_age_s)
            except OSError as exc:  # a failed sweep is tried again at the next
                log.warning("cannot delete old results in %s: %s", self.folder, exc)

    def write(self, image: Image.Image, seed: int) -> str:
        """`image` as a PNG file of its own, `seed-<seed>-<random>.png` (the name a download is saved
        as); returns its path. Two requests that make the same image get two files: one is never
        rewritten while the other is being downloaded.

        Raises:
            OSError: the file cannot be written (a full disk); nothing is left behind.
        """
        handle, staging = tempfile.mkstemp(dir=self.folder, prefix=".writing-", suffix=".png")
        try:
            with os.fdopen(handle, "wb") as file:
                image.save(file, format="PNG")
            final = self.folder / f"seed-{seed}-{secrets.token_hex(6)}.png"
            os.replace(staging, final)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
        return str(final)


def sweep(root: Path) -> list[Path]:
    """Remove the run folders under `root` whose lock nobody holds; returns them. A folder still
    without its lock file is left alone for `CREATING_S` seconds (its process is making it)."""
    removed = []
    for folder in sorted(root.glob("run-*")):
        lock = folder / LOCK_NAME
        try:
            if locks.held(lock) or (not lock.exists() and time.time() - folder.stat().st_mtime < CREATING_S):
                continue
        except FileNotFoundError:  # another process swept it meanwhile
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
