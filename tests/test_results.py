"""Result files (aot/results.py): written whole or not at all, deleted after their age, and what an
earlier run left is removed at start, told by a lock rather than a PID."""

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TINY, Server
from gradio.utils import is_static_file
from gradio_client import Client
from PIL import Image

from aot import locks
from aot.results import LOCK_NAME, ROOT_NAME, Results, delete_cache


def pngs(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.png"))


def test_a_write_that_fills_the_disk_leaves_nothing_and_the_next_one_works(tmp_path, monkeypatch):
    # A writer that raises ENOSPC halfway, as a full disk does (no tmpfs can be mounted here).
    results = Results(3600, tmp_path)
    save = Image.Image.save

    def fills_up(image, file, *args, **kwargs):
        file.write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", fills_up)
    with pytest.raises(OSError, match="No space left on device"):
        results.write(Image.new("RGB", (8, 8)), 1)
    assert [p.name for p in results.folder.iterdir()] == [LOCK_NAME], "a half-written file was left"
    monkeypatch.setattr(Image.Image, "save", save)
    path = results.write(Image.new("RGB", (8, 8), (1, 2, 3)), 2)
    assert np.asarray(Image.open(path))[0, 0].tolist() == [1, 2, 3]


def test_an_earlier_runs_results_go_at_start_and_a_living_ones_stay(tmp_path):
    root = tmp_path / ROOT_NAME
    dead, living, creating = root / "run-dead", root / "run-living", root / "run-creating"
    for folder in (dead, living, creating):
        folder.mkdir(parents=True)
        (folder / "seed-1-abc.png").write_bytes(b"png")
    (dead / LOCK_NAME).touch()  # its process is gone: nobody holds the lock (its PID says nothing)
    (dead / ".writing-x.png").write_bytes(b"half")  # killed mid-write
    with locks.holding(living / LOCK_NAME):  # as the living process holds its own
        results = Results(3600, tmp_path)
    assert results.swept == [dead] and not dead.exists()
    assert (living / "seed-1-abc.png").exists(), "a living process's results were deleted"
    assert (creating / "seed-1-abc.png").exists(), "a folder still being made was deleted"


def test_a_killed_process_leaves_its_results_to_the_next(tmp_path):
    code = f"""
import os, signal, sys
sys.path.insert(0, {str(ROOT)!r})
from PIL import Image
from aot.results import Results
print(Results(3600, {str(tmp_path)!r}).write(Image.new("RGB", (8, 8)), 3), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode < 0, done.stderr[-2000:]
    left = Path(done.stdout.strip())
    assert left.exists()
    Results(3600, tmp_path)
    assert not left.exists() and not left.parent.exists()


@pytest.mark.parametrize(("age", "expected"), [(5, (5, 5)), (3600, (60, 3600))])
def test_the_sweep_runs_often_enough_for_the_age(age, expected):
    assert delete_cache(age) == expected


def test_results_older_than_the_age_are_deleted_and_younger_ones_kept(tmp_path):
    results = Results(3600, tmp_path)
    old, young = (results.write(Image.new("RGB", (8, 8)), seed) for seed in (1, 2))
    os.utime(old, (time.time() - 120, time.time() - 120))
    assert results.delete_older_than(60) == 1
    assert not os.path.exists(old) and os.path.exists(young)
    assert is_static_file(young), "gradio would copy it into its cache and track it"


def test_results_older_than_the_max_age_are_deleted_while_the_space_serves(tmp_path):
    cache = tmp_path / "gradio"
    env = {"MODEL_ID": TINY, "AOT_COMPILE": "0", "AOT_RESULTS_MAX_AGE": "5", "GRADIO_TEMP_DIR": str(cache)}
    app = Server(["app.py"], env, tmp_path / "app.log")
    try:
        app.wait_until_serving()
        client = Client(app.url, verbose=False)
        seen = set()  # each result on disk right after its request: ten requests may take longer than 5 s
        for i in range(10):
            path = Path(client.predict("a red cat", i, False, 512, 512, 1, api_name="/generate")[0])
            assert path.stat().st_size > 0
            seen.update(pngs(cache / ROOT_NAME))
        assert len(seen) == 10, seen
        time.sleep(30)
        assert pngs(cache / ROOT_NAME) == [], "results older than AOT_RESULTS_MAX_AGE=5 are still there"
        assert client.predict("a red cat", 1, False, 512, 512, 1, api_name="/generate")[1] == 1
    finally:
        app.stop()
