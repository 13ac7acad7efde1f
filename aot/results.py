"""Result files: each image a PNG of its own, written atomically, none kept for ever.

A request's image is written into this process's own folder under gradio's cache
(`<GRADIO_TEMP_DIR or /tmp/gradio>/aot-results/run-*`), first under a temporary name, then renamed:
a client never downloads half a file, and a kill mid-write leaves no truncated PNG under a result's
name. gradio serves the path as it is and, given `gr.Blocks(delete_cache=delete_cache(age))`,
deletes it once it is older than `--results-max-age`.

What a process that died left (a kill, a crash, a restart of the Space) goes when the next one
starts: each process holds the lock of its folder while it lives (`locks.hold`), so a folder whose
lock nobody holds is an earlier run's, whatever its PID.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from gradio.utils import get_upload_folder
from PIL import Image

from aot import locks

ROOT_NAME = "aot-results"
LOCK_NAME = ".lock"
# A run folder still without its lock file is being created: it is left alone for this long.
CREATING_S = 60
# gradio's sweep runs every `max_age` seconds, but at least this often.
SWEEP_EVERY_S = 60


def delete_cache(max_age_s: int) -> tuple[int, int]:
    """gradio's `delete_cache=(frequency, age)` that keeps a result about `max_age_s` seconds: files
    older than that go at the next sweep, which runs every `max_age_s` seconds, at most every
    `SWEEP_EVERY_S`. gradio deletes the uploads it keeps on the same schedule."""
    return min(max_age_s, SWEEP_EVERY_S), max_age_s


class Results:
    """This process's folder of result files (`folder`), whose lock it holds while it lives.

    Making one removes the folders of earlier runs (`swept`: their processes are gone).

    Args:
        cache: the folder to keep results under (default: gradio's cache folder).

    Raises:
        OSError: the folder cannot be made or locked (a read-only or full disk).
    """

    def __init__(self, cache: str | os.PathLike | None = None):
        root = Path(cache or get_upload_folder()) / ROOT_NAME
        root.mkdir(parents=True, exist_ok=True)
        self.swept = sweep(root)
        self.folder = Path(tempfile.mkdtemp(prefix="run-", dir=root))
        locks.hold(self.folder / LOCK_NAME)

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
