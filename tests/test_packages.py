"""Saved packages (CPU, tiny pipeline): save, load in a fresh process, every kind of stale or broken set."""

import contextlib
import dataclasses
import json
import logging
import os
import pickle
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, TOLERANCE, decided, generate, load_tiny, optimize, tiny_options
from diffusers import FluxTransformer2DModel

from aot import destinations, loading, locks, portability, saving
from aot.blocks import rel_error
from aot.destinations import HubRepo, hub_label, hub_repo
from aot.loading import load_packages
from aot.plans import Trials
from aot.saving import push_packages, save_packages

ROOT = Path(__file__).resolve().parents[1]
VARIANT = "sdpa-float32-512-1536"  # attention sdpa, float32 weights, default sides: what the CPU compiles
CLASSES = ("FluxTransformerBlock", "FluxSingleTransformerBlock")


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    """A private copy of the saved folder to break."""
    return Path(shutil.copytree(saved, tmp_path / "packages"))


def test_layout_is_what_spaces_reads_and_holds_no_weights_or_paths(saved):
    assert sorted(p.name for p in saved.iterdir()) == sorted(
        [f"config.{VARIANT}.json", *(f"{c}.{VARIANT}" for c in CLASSES)]
    )
    config = (saved / f"config.{VARIANT}.json").read_text()
    cpu_isa = portability.isa_built_for(torch.device("cpu"))  # a CPU compile's
    assert json.loads(config)["fingerprint"]["cpu_isa"] == cpu_isa
    for private in (str(ROOT), str(Path.home()), str(saved), "/tmp/"):
        assert private not in config
    for block in CLASSES:
        names = zipfile.ZipFile(saved / f"{block}.{VARIANT}" / "package.pt2").namelist()
        assert any(n.endswith(".so") for n in names)
        assert not [n for n in names if "weight" in n or "constants" in n], names


def test_fresh_process_binds_saved_packages_without_compiling(saved, tmp_path, eager_pipe):
    # The compile entry points are replaced by functions that fail: loading must not need them, nor
    # the CPU ISA probe that compiling needs (43.6 s on the H200 host).
    script = f"""
import sys, numpy as np, torch
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
import compile
from aot import export, pipeline
def refuse(*args, **kwargs):
    raise AssertionError("compiled although packages were saved")
export.export_block = export.compile_package = export.compile_blocks = compile.compile_blocks = refuse
from conftest import generate, optimize, tiny_options
from torch._inductor.cpu_vec_isa import valid_vec_isa_list
options = tiny_options(load={str(saved)!r}, strict=True)
pipe = pipeline.load_pipeline(options)
report = optimize(pipe, options)
print(report.source)
np.save({str(tmp_path / "image.npy")!r}, generate(pipe, 768, 512).numpy())
print("ISA probes:", valid_vec_isa_list.cache_info().misses)  # a warm start needs none (runner.load_runner)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"loaded from {saved}" in done.stdout
    assert "ISA probes: 0" in done.stdout
    actual = torch.from_numpy(np.load(tmp_path / "image.npy"))
    assert rel_error(actual, generate(eager_pipe, 768, 512)) < TOLERANCE


def _edit_fingerprint(folder: Path, **changes) -> None:
    path = folder / f"config.{VARIANT}.json"
    config = json.loads(path.read_text())
    config["fingerprint"].update(changes)
    path.write_text(json.dumps(config))


def _package(folder: Path) -> Path:
    return folder / f"FluxSingleTransformerBlock.{VARIANT}" / "package.pt2"


def _edit_config(folder: Path, edit) -> None:
    path = folder / f"config.{VARIANT}.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _rename_block(folder: Path, new: str) -> None:
    """The single-block class's entry and folder renamed to `new` (the package stays valid)."""
    old = "FluxSingleTransformerBlock"
    _edit_config(folder, lambda c: c["blocks"].__setitem__(new, c["blocks"].pop(old)))
    os.rename(folder / f"{old}.{VARIANT}", folder / f"{new}.{VARIANT}")


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = slice(len(data) // 2, len(data) // 2 + 64)
    data[middle] = bytes(b ^ 0xFF for b in data[middle])  # always a change (zeroing may hit zero padding)
    path.write_bytes(bytes(data))


BREAKAGES = {
    "other torch": (lambda f: _edit_fingerprint(f, torch="2.0.0"), r"torch: 2\.0\.0 \(packages\) vs"),
    "other device": (lambda f: _edit_fingerprint(f, device="cuda sm_90"), r"device: cuda sm_90 \(packages\) vs cpu"),
    "other CPU architecture": (
        lambda f: _edit_fingerprint(f, machine="riscv64"),
        rf"machine: riscv64 \(packages\) vs {platform.machine()} \(here\)",
    ),
    "CPU ISA this CPU lacks": (
        lambda f: _edit_fingerprint(f, cpu_isa="avx2 no_such_flag"),
        "built for CPU ISA 'avx2 no_such_flag'; this CPU lacks .*no_such_flag",
    ),
    # A package set built on a newer system (e.g. Ubuntu 24.04's glibc 2.39) and loaded on an older one.
    "newer glibc": (
        lambda f: _edit_fingerprint(f, glibc="2.99"),
        r"the packages need glibc 2\.99 \(they were built on a newer system\); this machine has",
    ),
    "newer libstdc++": (
        lambda f: _edit_fingerprint(f, glibcxx="3.4.99"),
        r"the packages need glibcxx 3\.4\.99 \(they were built on a newer system\); this machine has",
    ),
    "glibc not a version": (
        lambda f: _edit_fingerprint(f, glibc="abc"),
        "the packages record glibc 'abc', which is not a version",
    ),
    "missing package": (lambda f: _package(f).unlink(), "package.pt2 is missing"),
    "truncated package": (lambda f: _package(f).write_bytes(_package(f).read_bytes()[:1000]), "truncated"),
    "corrupt package": (lambda f: _flip_bytes(_package(f)), "does not match its SHA-256"),
    "missing config": (lambda f: (f / f"config.{VARIANT}.json").unlink(), f"no config.{VARIANT}.json"),
    "unreadable config": (lambda f: (f / f"config.{VARIANT}.json").write_text("{"), "is unreadable"),
    # Before: KeyError in apply_, no recompile.
    "renamed block class": (
        lambda f: _rename_block(f, "RenamedBlock"),
        r"lists block classes \['FluxTransformerBlock', 'RenamedBlock'\]",
    ),
}


def test_packages_that_need_no_vector_extension_load_on_this_cpu(copy):
    # "" is what a CUDA compile records on x86-64 Linux (portability.isa_built_for).
    assert portability.isa_problem("") is None
    _edit_fingerprint(copy, cpu_isa="")
    compiled, reason = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is not None, reason
    assert compiled.fingerprint["cpu_isa"] == ""


@pytest.mark.parametrize("kind", BREAKAGES)
def test_unusable_packages_are_refused_with_the_reason(copy, kind):
    breakage, reason = BREAKAGES[kind]
    breakage(copy)
    with pytest.raises(RuntimeError, match=reason):  # strict: no silent fallback, and no compile
        optimize(load_tiny(), tiny_options(load=str(copy), strict=True))


def test_unusable_packages_are_recompiled_with_the_reason_logged(copy, caplog, eager_pipe, monkeypatch):
    # Without strict the same check falls back to compiling (one breakage: every reason above is
    # the same `load_packages` answer, and each fallback compile costs half a minute on a CPU).
    # The GPU's trials are worked out once, and the compile walks the ones the load path looked for.
    breakage, reason = BREAKAGES["corrupt package"]
    breakage(copy)
    pipe = load_tiny()
    resolved, resolve = [], Trials.resolve.__func__

    def counted(cls, *args):
        resolved.append(resolve(cls, *args))
        return resolved[-1]

    monkeypatch.setattr(Trials, "resolve", classmethod(counted))
    with caplog.at_level(logging.WARNING, logger="compile"):
        report = optimize(pipe, tiny_options(load=str(copy)))
    assert report.source == "compiled"
    assert len(resolved) == 1, "the load path and the compile path each worked out the GPU's trials"
    assert report.compiled.decisions[0] is resolved[0].planned
    assert any("not used" in r.message and re.search(reason, r.message) for r in caplog.records)
    assert rel_error(generate(pipe, 512, 512), generate(eager_pipe, 512, 512)) < TOLERANCE


def _reads_update_atime(path: Path) -> bool:
    """Whether reading a file shows in its access time here (not on noatime mounts)."""
    os.utime(path, (0, path.stat().st_mtime))
    path.read_bytes()
    return path.stat().st_atime != 0


def _never_read(path: Path):
    """Set `path`'s access time to 0; the returned check says whether it is still unread."""
    control = path.with_name(path.name + ".control")
    shutil.copyfile(path, control)
    detects = _reads_update_atime(control)
    os.utime(path, (0, path.stat().st_mtime))
    return lambda: not detects or path.stat().st_atime == 0


def _outside_copy(folder: Path, tmp_path: Path) -> Path:
    """A valid copy of the single-block class's folder outside the package folder."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    return Path(shutil.copytree(_package(folder).parent, outside / _package(folder).parent.name))


@pytest.mark.parametrize("link", ["package.pt2", "block folder", "config"])
def test_symbolic_links_inside_the_folder_are_refused_unread(copy, tmp_path, link, caplog):
    # The link's target is a valid copy, so anything but a refusal means it was followed.
    target = _outside_copy(copy, tmp_path)
    if link == "package.pt2":
        _package(copy).unlink()
        _package(copy).symlink_to(target / "package.pt2")
        target, shown = target / "package.pt2", f"FluxSingleTransformerBlock.{VARIANT}/package.pt2"
    elif link == "block folder":
        shutil.rmtree(_package(copy).parent)
        _package(copy).parent.symlink_to(target, target_is_directory=True)
        target, shown = target / "package.pt2", f"FluxSingleTransformerBlock.{VARIANT}"
    else:
        config = copy / f"config.{VARIANT}.json"
        target = Path(shutil.copyfile(config, tmp_path / "outside" / "config.json"))
        config.unlink()
        config.symlink_to(target)
        shown = config.name
    unread = _never_read(target)
    with caplog.at_level(logging.DEBUG):
        compiled, reason = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is None
    assert reason == f"{shown} is a symbolic link; only regular files inside the folder are read"
    assert unread(), f"{target} was read"
    size = str(target.stat().st_size)
    assert not any(size in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("kind", ["../ name", "absolute name", "extra absolute entry", "missing entry"])
def test_block_names_in_the_config_must_be_the_models_classes(copy, tmp_path, kind):
    # Each name points at a valid package outside the folder: a loader using it as a path would load it.
    outside = _outside_copy(copy, tmp_path)
    if kind == "../ name":
        name = os.path.relpath(outside.parent / "FluxSingleTransformerBlock", copy)  # ../outside/...
        assert name.startswith("..")
        _edit_config(copy, lambda c: c["blocks"].__setitem__(name, c["blocks"].pop("FluxSingleTransformerBlock")))
    elif kind == "absolute name":
        name = str(outside.parent / "FluxSingleTransformerBlock")
        _edit_config(copy, lambda c: c["blocks"].__setitem__(name, c["blocks"].pop("FluxSingleTransformerBlock")))
    elif kind == "extra absolute entry":
        name = str(outside.parent / "FluxSingleTransformerBlock")
        _edit_config(copy, lambda c: c["blocks"].__setitem__(name, c["blocks"]["FluxSingleTransformerBlock"]))
    else:
        _edit_config(copy, lambda c: c["blocks"].pop("FluxSingleTransformerBlock"))
    unread = _never_read(outside / "package.pt2")
    compiled, reason = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is None
    assert reason.startswith(f"config.{VARIANT}.json lists block classes [")
    assert reason.endswith("this model's repeated blocks are ['FluxSingleTransformerBlock', 'FluxTransformerBlock']")
    assert unread(), "a file outside the folder was read"


def _set_meta(field, value):
    return lambda c: c["blocks"]["FluxTransformerBlock"].__setitem__(field, value)


MALFORMED = {
    "not UTF-8": (b"\xff\xfe{}", "is unreadable"),
    "not an object": ([], "is malformed: not a JSON object"),
    "no blocks": (lambda c: c.pop("blocks"), "is malformed: no fingerprint or blocks object"),
    "fingerprint a list": (lambda c: c.__setitem__("fingerprint", []), "no fingerprint or blocks object"),
    "blocks a list": (lambda c: c.__setitem__("blocks", ["FluxTransformerBlock"]), "no fingerprint or blocks"),
    "bytes a string": (_set_meta("bytes", "1294"), "FluxTransformerBlock needs bytes"),
    "sha256 a number": (_set_meta("sha256", 1), "FluxTransformerBlock needs bytes"),
    "fp8 a string": (_set_meta("fp8", "no"), "FluxTransformerBlock needs bytes"),
    "decisions a string": (lambda c: c.__setitem__("decisions", "sdpa"), "decisions must be"),
    "unknown fp8 granularity": (lambda c: c.__setitem__("fp8_granularity", 3), "fp8_granularity must be"),
    "fingerprint block a number": (
        lambda c: c["fingerprint"]["blocks"].__setitem__("FluxTransformerBlock", 3),
        "has a malformed fingerprint: TypeError",
    ),
    "cpu_isa a number": (lambda c: c["fingerprint"].__setitem__("cpu_isa", 1), "records cpu_isa 1, not a string"),
    "no glibc": (lambda c: c["fingerprint"].pop("glibc"), "records no glibc"),
    "glibc a number": (lambda c: c["fingerprint"].__setitem__("glibc", 2.38), "records glibc 2.38, not a string"),
    "no contract": (_set_meta("contract", None), "FluxTransformerBlock metadata is malformed: TypeError"),
    "dtype not a dtype": (
        lambda c: c["blocks"]["FluxTransformerBlock"]["contract"]["tensors"][0].__setitem__("dtype", "load"),
        "FluxTransformerBlock metadata is malformed: ValueError: 'load' is not a torch dtype",
    ),
    "tree not a tree": (
        lambda c: c["blocks"]["FluxTransformerBlock"]["contract"].__setitem__("tree", "[1, {}]"),
        "FluxTransformerBlock metadata is malformed: KeyError",
    ),
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_config_is_one_reason_line_never_a_traceback(copy, kind):
    edit, reason = MALFORMED[kind]
    path = copy / f"config.{VARIANT}.json"
    if isinstance(edit, bytes):
        path.write_bytes(edit)
    elif isinstance(edit, list):
        path.write_text(json.dumps(edit))
    else:
        _edit_config(copy, edit)
    compiled, got = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is None and reason in got and "\n" not in got, got
    with pytest.raises(RuntimeError, match=re.escape(reason)):  # strict: the same reason, raised
        optimize(load_tiny(), tiny_options(load=str(copy), strict=True))


def test_packages_for_other_options_or_another_model_are_refused(saved):
    _, reason = load_packages(str(saved), *decided(load_tiny(), tiny_options(max_side=1024)))
    assert f"no config.sdpa-float32-512-1024.json in {saved} (found: config.{VARIANT}.json)" == reason
    pipe = load_tiny()
    config = dict(pipe.transformer.config)
    config["num_attention_heads"] = 4
    pipe.transformer = FluxTransformer2DModel.from_config(config)
    compiled, reason = load_packages(str(saved), *decided(pipe, tiny_options()))
    assert compiled is None and "FluxTransformerBlock weights differ" in reason


def test_interrupted_save_leaves_the_previous_packages_usable(saved, copy, compiled, tmp_path):
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    pickled = tmp_path / "compiled.pkl"
    pickled.write_bytes(pickle.dumps(compiled))
    # A save killed (os._exit, like SIGKILL) right before its config is written.
    script = f"""
import os, pickle, sys
sys.path.insert(0, {str(ROOT)!r})
from aot import saving
write = saving._write
saving._write = lambda path, data: os._exit(9) if path.name.startswith("config") else write(path, data)
saving.save_packages(pickle.loads(open({str(pickled)!r}, "rb").read()), {str(copy)!r})
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr[-2000:]
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    assert load_packages(str(copy), *decided(load_tiny(), tiny_options()))[0] is not None
    save_packages(compiled, copy)  # the next save cleans up what the killed one left
    assert _beside(copy) == []


def test_save_stopped_between_its_two_renames_is_recovered(copy):
    old = copy.with_name(".packages.old-0123abcd")
    os.rename(copy, old)  # where a kill between the renames leaves the previous set
    compiled, reason = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is not None, reason
    assert copy.is_dir() and not old.exists()


def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _beside(folder: Path) -> list[str]:
    """What a save left beside `folder` (`.packages.staging-*`, `.packages.old-*`), but its lock file,
    which stays (removing a lock file others may have open would let two saves run at once)."""
    return sorted(p.name for p in folder.parent.glob(f".{folder.name}.*") if p.name != f".{folder.name}.lock")


@contextlib.contextmanager
def _immutable(path: Path):
    """`chattr +i path` for the block (root cannot write into it either); skips where unsupported."""
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("kind", ["folder is a file", "parent is a file", "immutable folder", "immutable parent"])
def test_a_save_target_that_cannot_be_written_is_refused_before_compiling(copy, tmp_path, kind):
    target, expected = copy, None
    if kind == "folder is a file":
        target = tmp_path / "file"
        target.write_text("not a folder")
        expected = f"{target} is a file, not a folder"
    elif kind == "parent is a file":
        (tmp_path / "file").write_text("not a folder")
        target = tmp_path / "file" / "sub" / "packages"
        expected = f"{tmp_path / 'file'} is a file, not a folder"
    pipe = load_tiny()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    before = _files(copy)
    locked = copy if kind == "immutable folder" else copy.parent if kind == "immutable parent" else None
    with _immutable(locked) if locked else contextlib.nullcontext():
        with pytest.raises(RuntimeError, match=f"cannot save packages into {re.escape(str(target))}: ") as raised:
            optimize(pipe, tiny_options(save=str(target)))
    assert not calls, "the pipeline ran before the save target was checked"
    if expected:
        assert str(raised.value).endswith(expected)
    else:
        assert str(raised.value).endswith(
            f"{locked} is not writable "
            + (
                "(the old copy could not be deleted)"
                if kind == "immutable folder"
                else "(the new folder is built in it)"
            )
        )
    assert _files(copy) == before and _beside(copy) == []


def test_a_read_only_folder_is_refused_without_leftovers(saved, compiled, copy, tmp_path):
    # Before: the save "succeeded", replaced the read-only folder and left a read-only .old-* copy.
    # Permission bits do not stop root: as root the save runs without CAP_DAC_OVERRIDE (setpriv).
    for folder in [copy, *[p for p in copy.rglob("*") if p.is_dir()]]:
        folder.chmod(0o555)
    pickled = tmp_path / "compiled.pkl"
    pickled.write_bytes(pickle.dumps(compiled))
    script = f"""
import pickle, sys
sys.path.insert(0, {str(ROOT)!r})
from aot import saving
try:
    saving.save_packages(pickle.loads(open({str(pickled)!r}, "rb").read()), {str(copy)!r})
except RuntimeError as exc:
    print(exc)
"""
    command = [sys.executable, "-c", script]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: permission bits cannot be tested")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    before = _files(copy)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        f"cannot save packages into {copy}: {copy} is not writable (the old copy could not be deleted)" in done.stdout
    )
    assert _files(copy) == before and _beside(copy) == []
    assert (copy.stat().st_mode & 0o777) == 0o555


def test_a_failed_swap_leaves_the_folder_as_it_was(copy, compiled, monkeypatch):
    before = _files(copy)
    # The second rename fails (another process recreated the folder, a full disk...): the old folder is put back.
    rename = os.rename

    def failing_rename(src, dst):
        if ".staging-" in str(src):
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="No space left"):
        save_packages(
            dataclasses.replace(compiled, fingerprint={**compiled.fingerprint, "sizes": [512, 1024, 16]}), copy
        )
    monkeypatch.undo()
    assert _files(copy) == before and _beside(copy) == []
    # The first rename fails for real: an immutable folder, with the check before it skipped.
    with _immutable(copy):
        with pytest.raises(PermissionError):
            saving._swap(copy, lambda staging: (staging / "new").write_text("x"))
    assert _files(copy) == before and _beside(copy) == []


def test_leftovers_of_dead_saves_are_cleaned_on_load_whatever_pid_they_name(copy, tmp_path):
    # Before: a leftover named with a running process's PID counted as a save under way, and in a
    # container the app is PID 1 at every start: it was never restored or removed, and the load failed.
    # This test's own PID stands for that: no save holds the lock, so these are a dead save's.
    pid = os.getpid()
    staging = copy.with_name(f".packages.staging-{pid}-k2j4")
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "file").write_text("half written")
    for folder in (staging / "sub", staging):
        folder.chmod(0o555)  # read-only leftovers go too
    old = Path(shutil.copytree(copy, copy.with_name(f".packages.old-{pid}-0123abcd")))
    legacy = Path(shutil.copytree(copy, copy.with_name(".packages.old-89abcdef")))
    outside = tmp_path / "outside-folder"
    outside.mkdir()
    (outside / "keep").write_text("not ours")
    link = copy.with_name(f".packages.old-{pid}-deadbeef")
    link.symlink_to(outside, target_is_directory=True)
    compiled, reason = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is not None, reason
    assert not any(os.path.lexists(p) for p in (staging, old, legacy, link))
    assert (outside / "keep").read_text() == "not ours", "a link was followed"
    assert _beside(copy) == []


def test_a_save_stopped_between_its_renames_with_the_same_pid_is_restored(copy):
    # The same container restart: the previous set sits as .old-<this PID>-*, the folder is missing.
    os.rename(copy, copy.with_name(f".packages.old-{os.getpid()}-0123abcd"))
    compiled, reason = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is not None, reason
    assert copy.is_dir() and _beside(copy) == []


def test_what_a_save_under_way_has_beside_it_stays(copy):
    # A save holds `.packages.lock` while it runs (here this process holds it, as another saver would):
    # a load meanwhile leaves its staging folder alone.
    live = copy.with_name(".packages.staging-live")
    live.mkdir()
    with locks.holding(copy.with_name(".packages.lock")):
        compiled, reason = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is not None, reason
    assert _beside(copy) == [live.name]


def test_a_leftover_that_cannot_be_removed_is_not_reported_removed(tmp_path, caplog):
    # Before: a --load from a read-only place logged "cannot remove X", then "removed X".
    # Permission bits do not stop root: as root the tidy runs without CAP_DAC_OVERRIDE (setpriv).
    parent = tmp_path / "read-only"
    folder = parent / "packages"
    leftover = parent / ".packages.staging-k2j4"
    (leftover / "sub").mkdir(parents=True)
    folder.mkdir()
    parent.chmod(0o555)
    script = f"""
import logging, sys
from pathlib import Path
sys.path.insert(0, {str(ROOT)!r})
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from aot import saving
saving._tidy(Path({str(folder)!r}))
"""
    command = [sys.executable, "-c", script]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: a read-only folder cannot be tested")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        parent.chmod(0o755)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"WARNING cannot remove {leftover}: [Errno 13] Permission denied" in done.stdout, done.stdout
    assert f"removed {leftover}" not in done.stdout, done.stdout
    assert leftover.is_dir()
    with caplog.at_level(logging.INFO, logger="packages"):
        saving._tidy(folder)  # writable now: removed, and said so
    assert not leftover.exists()
    assert [r.getMessage() for r in caplog.records] == [f"removed {leftover}, left by an interrupted save"]


def test_a_relative_folder_stopped_between_the_renames_is_still_local(saved, tmp_path, monkeypatch):
    # Before: rel/pk was missing, so `rel/pk` was taken for a Hub repo id.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel").mkdir()
    assert destinations.hub_repo("rel/pk") is not None  # nothing there: owner/name is a Hub repo
    shutil.copytree(saved, tmp_path / "rel" / ".pk.old-0123abcd")
    assert destinations.hub_repo("rel/pk") is None
    compiled, reason = load_packages("rel/pk", *decided(load_tiny(), tiny_options()))
    assert compiled is not None, reason
    assert compiled.source == "loaded from rel/pk"
    assert (tmp_path / "rel" / "pk").is_dir() and _beside(tmp_path / "rel" / "pk") == []


def test_packages_of_another_size_range_live_beside(saved, compiled, copy):
    other = dataclasses.replace(compiled, fingerprint={**compiled.fingerprint, "sizes": [512, 1024, 16]})
    save_packages(other, copy)
    assert (copy / "config.sdpa-float32-512-1024.json").is_file()
    assert load_packages(str(copy), *decided(load_tiny(), tiny_options()))[0] is not None  # 512..1536 still there


def test_push_to_the_hub_offline_fails_in_one_line_before_loading_anything(tmp_path):
    # HF_HUB_OFFLINE=1 with a token: the push would end in OfflineModeIsEnabled after the compile.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_not_a_real_token"}
    flags = ["--model", TINY, "--save", str(tmp_path / "p"), "--push", "someone/flux-blocks"]
    done = subprocess.run([sys.executable, "compile.py", *flags], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("compile.py: error: --push someone/flux-blocks: the Hub is switched off here"), last
    assert "Traceback" not in done.stderr and "Loading pipeline" not in done.stderr, done.stderr[-3000:]


def test_push_to_the_hub_without_a_token_fails_before_compiling(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no stored token either
    pipe = load_tiny()
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(RuntimeError, match="pushing to the Hub needs a token"):
        optimize(pipe, tiny_options(save=str(tmp_path / "p"), push="someone/flux-blocks"))
    assert not calls


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_hub_repos_and_pinned_revisions_are_told_from_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_repo("owner/name") == HubRepo("owner/name", None)
    assert hub_repo(f"owner/flux-blocks.v2@{COMMIT}") == HubRepo("owner/flux-blocks.v2", COMMIT)
    assert hub_repo("owner/name@v1.0") == HubRepo("owner/name", "v1.0")
    assert hub_repo("owner/name@refs/pr/3") == HubRepo("owner/name", "refs/pr/3")
    for folder in ["./owner/name", "/srv/owner/name", "packages", "a/b/c", "owner/name@", "owner/na me", "-x/y"]:
        assert hub_repo(folder) is None, folder
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert hub_repo("owner/name") is None  # an existing path is a folder


def test_the_report_names_the_commit_loaded_from_the_hub():
    # snapshot_download returns <cache>/models--owner--name/snapshots/<commit>, whatever revision was asked for.
    snapshot = Path("/cache/hub/models--owner--name/snapshots") / COMMIT
    assert hub_label(HubRepo("owner/name", "main"), snapshot) == f"owner/name@{COMMIT}"
    assert hub_label(HubRepo("owner/name"), snapshot) == f"owner/name@{COMMIT}"
    assert hub_label(HubRepo("owner/name", "v1"), Path("/elsewhere/v1")) == "owner/name@v1 (commit unknown)"


def test_a_push_with_a_revision_is_refused():
    with pytest.raises(RuntimeError, match=r"push to owner/name; a revision \(@\.\.\.\) is for --load only"):
        destinations.check_push_target("owner/name@main")


@pytest.mark.parametrize("writable", [None, "folder", "block folder", "package"])
def test_packages_others_can_write_are_loaded_with_a_warning(copy, caplog, writable):
    # Before: loaded without a word, though whoever can write there can run code in the Space.
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    block = copy / f"FluxTransformerBlock.{VARIANT}"
    changed = {"folder": (copy, 0o777), "block folder": (block, 0o775), "package": (block / "package.pt2", 0o646)}
    if writable:
        path, mode = changed[writable]
        path.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="packages"):
        compiled, reason = load_packages(str(copy), *decided(load_tiny(), tiny_options()))
    assert compiled is not None, reason
    warnings = [r.getMessage() for r in caplog.records if "can be written by group or other users" in r.getMessage()]
    if writable is None:
        assert warnings == []
    else:
        assert len(warnings) == 1, warnings
        assert warnings[0].startswith(f"{path} (mode {mode:o}) can be written by group or other users: "), warnings
        assert warnings[0].endswith(f"chmod -R go-w {copy}")


def test_hub_cache_links_are_followed_only_inside_the_cache(tmp_path):
    # huggingface_hub's cache layout: snapshot files link to the repo's blobs, which may link on to
    # the cache-wide shared store. Built by hand here: no download is involved.
    cache = tmp_path / "hub"
    repo = cache / "models--owner--name"
    snapshot = repo / "snapshots" / COMMIT
    (snapshot / "Block.v").mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "e1").write_bytes(b"config")
    (cache / "blobs" / "ab").mkdir(parents=True)
    (cache / "blobs" / "ab" / "ab12").write_bytes(b"package")
    (repo / "blobs" / "e2").symlink_to("../../blobs/ab/ab12")
    (snapshot / "config.json").symlink_to("../../blobs/e1")
    (snapshot / "Block.v" / "package.pt2").symlink_to("../../../blobs/e2")
    (tmp_path / "secret").write_bytes(b"secret")
    (snapshot / "out.json").symlink_to(tmp_path / "secret")
    with loading._open_inside(snapshot, "config.json", cache) as f:
        assert f.read() == b"config"
    with loading._open_inside(snapshot, "Block.v/package.pt2", cache) as f:
        assert f.read() == b"package"
    with pytest.raises(loading.Refused, match=f"out.json is a link out of the Hub cache {cache}"):
        loading._open_inside(snapshot, "out.json", cache)
    with pytest.raises(loading.Refused, match="config.json is a symbolic link"):
        loading._open_inside(snapshot, "config.json")  # a local folder: no link is followed


def test_push_to_a_local_folder_then_load_from_it(saved, tmp_path):
    target = tmp_path / "hub-stand-in"
    assert push_packages(saved, str(target)) == str(target)
    push_packages(saved, str(target))  # pushing again replaces the same variant
    compiled, reason = load_packages(str(target), *decided(load_tiny(), tiny_options()))
    assert compiled is not None, reason
    assert compiled.source == f"loaded from {target}"


def test_cli_loads_saved_packages(saved, monkeypatch, capsys):
    # compile.main as `python compile.py` runs it (test_options.py runs compile.py itself, in a process).
    import compile

    monkeypatch.setenv("MODEL_ID", TINY)
    assert compile.main(["--load", str(saved), "--strict"]) == 0
    assert f"packages loaded from {saved}" in capsys.readouterr().out
