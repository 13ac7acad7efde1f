"""Compiled packages on disk and on the Hub: save, verify, load, push.

Layout (what `spaces.aoti_blocks_load(transformer, repo_id, variant=...)` reads):

    DIR/config.<variant>.json                 kernels to load first, the fingerprint, per-class metadata
    DIR/<BlockClass>.<variant>/package.pt2    one weights-less AOTInductor package per block class

The variant names the graph-changing choices, e.g. `fa3-fp8row-512-1536`. The fingerprint
records what a package is valid for: library versions, CPU architecture, CUDA and compute
capability, dtype, size range, attention and FP8 choices, and per block class its forward signature
and weight names, shapes and dtypes; plus the vector extensions of the CPU it was built on, which its
C++ may use. A package is used only when every field matches here, this CPU has those extensions,
and its bytes match the recorded SHA-256, so a stale, truncated or foreign package never reaches
the native loader.
A save writes the new set beside the folder and swaps it in with two renames, so no reader sees a
half-written set.
Neither weights nor tokens are written. (AOTInductor itself embeds its build command, with the
build machine's include paths, in each package's sources and debug info.)

A package is native code that runs in this process once loaded: its SHA-256 guards against
corruption, not against its publisher (README, Trust). Load only what you control; pin Hub repos
as `owner/name@<commit>`.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from aot import locks, native
from aot.blocks import BlockPackage, Compiled, dtype_name, forward_signature, repeated_blocks
from aot.fast_paths import FA3_KERNEL_VERSION, Decision, Trials, one_line
from aot.options import Options, Resolution
from aot.target import Target

log = logging.getLogger("packages")
# 3: contracts give each dynamic dim as image and text coefficients (blocks.TensorSpec); 4: fp8 is the
# granularity the GPU's plan kept ("row", "tensor") or "off", per package and for the set.
SCHEMA = 4
PACKAGE = "package.pt2"


def fingerprint(
    transformer: torch.nn.Module,
    resolution: Resolution,
    attention: Decision,
    fp8: Decision,
    options: Options,
) -> dict[str, Any]:
    """What packages compiled for `transformer` under these decisions are valid for (JSON-able)."""
    import diffusers
    import kernels
    import torchao

    device = transformer.device
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        device_name = f"cuda sm_{major}{minor}"
    else:
        device_name = device.type
    blocks = repeated_blocks(transformer)
    return {
        "schema": SCHEMA,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchao": torchao.__version__,
        "diffusers": diffusers.__version__,
        "kernels": kernels.__version__,
        "device": device_name,
        # Each package holds C++ for this architecture; `compile_blocks` adds what it needs of the
        # CPU ("cpu_isa", native.isa_built_for) and of the runtime libraries ("glibc", "glibcxx":
        # native.runtimes_needed).
        "machine": platform.machine(),
        "dtype": dtype_name(transformer.dtype),
        "sizes": [resolution.min_side, resolution.max_side, resolution.step],
        "attention": attention.value,
        "fa3_kernel": options.fa3_kernel if attention.value == "fa3" else None,
        "fp8": fp8.value,  # the granularity, or off
        "blocks": {
            name: {
                "count": len(found),
                "forward": str(forward_signature(found[0])),
                "weights": [[n, list(t.shape), dtype_name(t.dtype)] for n, t in found[0].state_dict().items()],
            }
            for name, found in blocks.items()
        },
    }


def variant(fp: dict[str, Any]) -> str:
    """`fa3-fp8row-512-1536`, `sdpa-bfloat16-512-1536`, ...: the choices that change the graph
    (attention, FP8 or dtype, side range), so sets compiled for other choices live side by side."""
    precision = "fp8" + fp["fp8"] if fp["fp8"] != "off" else fp["dtype"]
    return f"{fp['attention']}-{precision}-{fp['sizes'][0]}-{fp['sizes'][1]}"


def differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Human-readable fingerprint differences, e.g. `torch: 2.11.0 (packages) vs 2.13.0 (here)`."""
    out = []
    for key in sorted(set(saved) | set(here)):
        if key in ("blocks", "cpu_isa", *native.RUNTIMES):  # the packages' needs: native.isa_problem, runtime_problem
            continue
        if saved.get(key) != here.get(key):
            out.append(f"{key}: {saved.get(key)} (packages) vs {here.get(key)} (here)")
    blocks_saved, blocks_here = saved.get("blocks", {}), here.get("blocks", {})
    for name in sorted(set(blocks_saved) | set(blocks_here)):
        a, b = blocks_saved.get(name), blocks_here.get(name)
        if a is None or b is None:
            out.append(f"block class {name}: {'missing from the packages' if a is None else 'not in this model'}")
            continue
        for field in ("count", "forward", "weights"):
            if a[field] != b[field]:
                detail = _first_weight_difference(a, b) if field == "weights" else f"{a[field]} vs {b[field]}"
                out.append(f"{name} {field} differ: {detail}")
    return out


def _first_weight_difference(a: dict, b: dict) -> str:
    saved, here = {w[0]: w[1:] for w in a["weights"]}, {w[0]: w[1:] for w in b["weights"]}
    for name in sorted(set(saved) | set(here)):
        if saved.get(name) != here.get(name):
            return f"{name} is {saved.get(name)} in the packages, {here.get(name)} here"
    return "order differs"


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


def check_save_target(target: str | os.PathLike) -> None:
    """Raise `RuntimeError` now if a save cannot replace the folder `target` (before compiling).

    A save builds the new folder beside `target`, renames `target` away and the new one in, then
    deletes the old one (`_swap`). So it is refused when `target` is a file; when the folder that
    would hold it (or the nearest existing one, to create it in) is a file or not writable; and when
    `target` or a folder inside it is not writable: its old copy could not be deleted, and a
    read-only `.old-*` copy would stay behind. `os.access` answers for this process: permission bits
    do not stop root, an immutable folder (`chattr +i`) or a read-only file system stops everyone.
    """
    directory = Path(target).resolve()
    parent = directory if not directory.exists() else directory.parent
    while not parent.exists():
        parent = parent.parent
    problem = None
    if directory.exists() and not directory.is_dir():
        problem = f"{directory} is a file, not a folder"
    elif not parent.is_dir():
        problem = f"{parent} is a file, not a folder"
    elif not os.access(parent, os.W_OK | os.X_OK):
        problem = f"{parent} is not writable (the new folder is built in it)"
    elif directory.is_dir():
        for root, _, _ in os.walk(directory):
            if not os.access(root, os.W_OK | os.X_OK):
                problem = f"{root} is not writable (the old copy could not be deleted)"
                break
    if problem:
        raise RuntimeError(f"cannot save packages into {target}: {problem}")


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


def _tidy_unless_saving(directory: Path) -> None:
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
    lock (`_swap`, `_tidy_unless_saving`), so no save of it is under way.

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


def load_saved(options: Options, pipe: Any, target: Target, trials: Trials) -> Compiled | None:
    """The packages of `options.load` for `pipe`, where they can be used here (`load_packages`);
    else None, with the reason logged (the caller compiles instead).

    Raises:
        RuntimeError: `options.strict` and they cannot be used, saying why.
    """
    compiled, reason = load_packages(options.load, pipe, options, target, trials)
    if compiled is None and options.strict:
        raise RuntimeError(f"packages from {options.load} cannot be used: {reason}")
    if compiled is None:
        log.warning("packages from %s not used: %s; compiling", options.load, reason)
    return compiled


def load_packages(
    source: str, pipe: Any, options: Options, target: Target | None = None, trials: Trials | None = None
) -> tuple[Compiled | None, str]:
    """Verified packages for `pipe` under `options` from a folder or Hub repo: the first variant, in
    the order of `trials` (this GPU's, as a compile here would walk them), whose fingerprint matches
    `target`'s resolution and the model here. `target` and `trials` are worked out here when not
    given (`compile_transformer` hands in the ones it gives the compile path).

    Returns `(compiled, "")`, or `(None, reason)` with a one-line reason when they cannot be used
    here: no such variant, a malformed config, block classes other than this model's, a fingerprint
    field that differs, a file that is missing, truncated, corrupt or not a regular file inside the
    folder (`_open_inside`). A local folder whose packages group or other users can write is
    loaded with a warning (`_warn_if_writable_by_others`).

    Raises:
        RuntimeError: a fast path explicitly requested in `options` cannot run here.
    """
    transformer = pipe.transformer
    resolution = (target or Target.of(pipe, options)).resolution
    trials = trials or Trials.resolve(options, transformer)
    candidates = {}  # variant -> fingerprint, in the plan's order: what a compile here would try
    for kernel in trials.attention:
        for granularity in [*trials.fp8, "off"]:
            attention, fp8 = Decision("attention", kernel, ""), Decision("fp8", granularity, "")
            here = fingerprint(transformer, resolution, attention, fp8, options)
            candidates.setdefault(variant(here), here)
    try:
        folder, label, cache = _fetch(source, list(candidates))
    except Exception as exc:  # network, auth, no such repo or revision
        return None, one_line(f"cannot read {source}: {type(exc).__name__}: {exc}", REASON_LIMIT)
    name = next((n for n in candidates if (folder / f"config.{n}.json").is_file()), next(iter(candidates)))
    here = candidates[name]
    try:
        packages, config = _read_packages(folder, source, name, here, resolution, cache)
    except Refused as exc:
        return None, one_line(str(exc), REASON_LIMIT)
    except OSError as exc:  # an unreadable file or folder (permissions, I/O error)
        return None, one_line(f"cannot read {source}: {type(exc).__name__}: {exc}", REASON_LIMIT)
    if cache is None:  # a local folder
        read = [f"config.{name}.json", *(f"{block}.{name}/{PACKAGE}" for block in config["blocks"])]
        _warn_if_writable_by_others(folder, read)
    decisions = [Decision(*d) for d in config["decisions"]]
    saved = config["fingerprint"]
    return Compiled(
        packages, decisions, resolution, here["fa3_kernel"], config["fp8_granularity"], saved, f"loaded from {label}"
    ), ""


def _warn_if_writable_by_others(folder: Path, relatives: list[str]) -> None:
    """Log one warning when `folder`, a file `relatives` names in it, or a folder between the two
    may be written by group or other users (S_IWGRP, S_IWOTH): a package is native code that runs in
    this process, so whoever can write there can run code in the Space. Its SHA-256 is no guard:
    the same user can rewrite the config beside it. Not refused: a shared folder may be intended.
    """
    paths = {folder}
    for relative in relatives:
        parts = relative.split("/")
        paths.update(folder.joinpath(*parts[:i]) for i in range(1, len(parts) + 1))
    writable = []
    for path in sorted(paths):
        try:
            mode = os.stat(path).st_mode  # `folder` may be a link (the user named it); nothing inside is
        except OSError:
            continue
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            writable.append(f"{path} (mode {stat.S_IMODE(mode):o})")
    if writable:
        more = f" and {len(writable) - 3} more" if len(writable) > 3 else ""
        log.warning(
            "%s%s can be written by group or other users: packages are native code that runs in this process, so "
            "whoever can write there can run code here; make them yours alone: chmod -R go-w %s",
            ", ".join(writable[:3]),
            more,
            folder,
        )


# A refusal's reason is one log line of at most this many characters.
REASON_LIMIT = 600


class Refused(Exception):
    """Why a saved package set is not used; its message is `load_packages`'s one-line reason."""


def _read_packages(
    folder: Path, source: str, name: str, here: dict[str, Any], resolution: Resolution, cache: Path | None = None
) -> tuple[dict[str, BlockPackage], dict[str, Any]]:
    """The verified packages of variant `name` in `folder`, and its config (`cache`: see `_open_inside`).

    Raises:
        Refused: see `load_packages`.
    """
    config_name = f"config.{name}.json"
    if not (folder / config_name).is_file():
        found = sorted(p.name for p in folder.glob("config.*.json")) if folder.is_dir() else []
        raise Refused(f"no {config_name} in {source} (found: {', '.join(found) or 'nothing'})")
    with _open_inside(folder, config_name, cache) as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise Refused(f"{config_name} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(raw)
    except ValueError as exc:  # bad JSON or bad UTF-8
        raise Refused(f"{config_name} is unreadable: {exc}") from None
    _check_config(config, config_name, sorted(here["blocks"]))
    saved = config["fingerprint"]
    try:
        diff = differences(saved, here)
    except (LookupError, TypeError, AttributeError) as exc:  # a fingerprint of another shape
        raise Refused(f"{config_name} has a malformed fingerprint: {type(exc).__name__}: {exc}") from None
    if diff:
        raise Refused("fingerprint differs: " + "; ".join(diff[:3]))
    checks = {"cpu_isa": native.isa_problem}
    checks.update({name: functools.partial(native.runtime_problem, name) for name in native.RUNTIMES})
    for key, check in checks.items():
        if key not in saved:
            raise Refused(f"{config_name} records no {key} (saved before it was recorded: compile again)")
        if not isinstance(saved[key], str):
            raise Refused(f"{config_name} records {key} {saved[key]!r}, not a string")
        problem = check(saved[key])
        if problem:
            raise Refused(problem)
    packages = {}
    for block, meta in config["blocks"].items():
        relative = f"{block}.{name}/{PACKAGE}"  # `block` is one of this model's class names (_check_config)
        with _open_inside(folder, relative, cache) as f:
            size = os.fstat(f.fileno()).st_size
            if size != meta["bytes"]:
                raise Refused(f"{relative} has {size} bytes, {meta['bytes']} were saved (truncated?)")
            data = f.read(meta["bytes"] + 1)
        if len(data) != meta["bytes"]:
            raise Refused(f"{relative} has {len(data)} bytes, {meta['bytes']} were saved (truncated?)")
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise Refused(f"{relative} does not match its SHA-256 (corrupt)")
        try:
            packages[block] = BlockPackage.from_metadata(block, data, meta, resolution)
        except Exception as exc:  # the metadata is data from a file: any decoding error is a refusal
            raise Refused(f"{config_name}: {block} metadata is malformed: {type(exc).__name__}: {exc}") from None
    return packages, config


# A config describes a few block classes: kilobytes. Anything far larger is not one of ours.
MAX_CONFIG_BYTES = 16 << 20


def _check_config(config: Any, config_name: str, classes: list[str]) -> None:
    """Raise `Refused` unless `config` has the shape `save_packages` writes, for exactly `classes`.

    Block names become folder names, so only this model's repeated block classes are accepted: no
    name from the file is used as a path (`../x`, `/x`), and a missing, extra or renamed class is
    refused here, not later in `apply_` (`KeyError`). Types are checked where a wrong one would
    fail after loading; the rest of each block's metadata is checked as it is decoded.
    """
    if not isinstance(config, dict):
        raise Refused(f"{config_name} is malformed: not a JSON object")
    blocks = config.get("blocks")
    if not isinstance(config.get("fingerprint"), dict) or not isinstance(blocks, dict):
        raise Refused(f"{config_name} is malformed: no fingerprint or blocks object")
    if sorted(blocks) != classes:
        raise Refused(
            f"{config_name} lists block classes {sorted(blocks)!r}; this model's repeated blocks are {classes!r}"
        )
    for block, meta in blocks.items():
        ok = (
            isinstance(meta, dict)
            and type(meta.get("bytes")) is int
            and meta["bytes"] >= 0
            and isinstance(meta.get("sha256"), str)
            and re.fullmatch(r"[0-9a-f]{64}", meta["sha256"]) is not None
            and meta.get("fp8", "") in ("row", "tensor", None)
        )
        if not ok:
            raise Refused(
                f"{config_name} is malformed: {block} needs bytes (int), sha256 (hex) and fp8 (row, tensor or null)"
            )
    decisions = config.get("decisions")
    if not isinstance(decisions, list) or not all(
        isinstance(d, list) and len(d) == 3 and all(isinstance(x, str) for x in d) for d in decisions
    ):
        raise Refused(f"{config_name} is malformed: decisions must be [name, value, reason] strings")
    if config.get("fp8_granularity", "") not in ("row", "tensor", None):
        raise Refused(f"{config_name} is malformed: fp8_granularity must be row, tensor or null")


def _open_inside(folder: Path, relative: str, cache: Path | None = None) -> BinaryIO:
    """Open the regular file `folder/relative` for reading, refusing anything else.

    Refused: a missing file; a symbolic link at any level below `folder` (it can point anywhere on
    this machine, and the loader would read, log the size of, and load what it points to); anything
    but a regular file (a FIFO or a device can block or never end). Each level is opened relative
    to the one above with O_NOFOLLOW, so a link swapped in after a check is not followed either.
    `folder` itself may be a link: the user named it.

    One exception: in a Hub snapshot (`cache`: huggingface_hub's cache folder), each file is the
    link huggingface_hub made to its blob, so a file that is a link is followed when its target,
    fully resolved, is a regular file inside `cache`; a link leading out of it is refused.

    Raises:
        Refused: see above.
    """
    parts = relative.split("/")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            shown = "/".join(parts[: depth + 1])
            try:
                mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                raise Refused(f"{shown} is missing") from None
            if stat.S_ISLNK(mode) and last and cache is not None:
                target = Path(os.path.realpath(folder / relative))
                if not target.is_relative_to(cache.resolve()):
                    raise Refused(f"{shown} is a link out of the Hub cache {cache}")
                os.close(fd)
                fd = -1
                fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                break
            if stat.S_ISLNK(mode):
                raise Refused(f"{shown} is a symbolic link; only regular files inside the folder are read")
            if not (stat.S_ISREG(mode) if last else stat.S_ISDIR(mode)):
                raise Refused(f"{shown} is not a {'regular file' if last else 'folder'}")
            flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError as exc:  # replaced since the check
                raise Refused(f"{shown} cannot be opened: {exc.strerror}") from None
            os.close(fd)
            fd = child
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused(f"{relative} is not a regular file")
        f, fd = os.fdopen(fd, "rb"), -1
        return f
    finally:
        if fd >= 0:
            os.close(fd)


@dataclass(frozen=True)
class HubRepo:
    """A Hub repo named by `owner/name` or `owner/name@revision` (a commit, branch or tag)."""

    repo_id: str
    revision: str | None = None


HUB_REPO = re.compile(r"([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@([\w.-][\w./-]*))?")
COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_repo(target: str) -> HubRepo | None:
    """The Hub repo `target` names, or None when it is a local folder.

    Local: a path starting with `.` or `/`, a path that exists, or one with a save's leftover
    beside it (`rel/.pk.old-*` or `rel/.pk.staging-*` for `rel/pk`: a save stopped between its two
    renames). Otherwise `owner/name` and `owner/name@revision` are Hub repos; anything else (`x`,
    `x/y/z`) is a folder.
    """
    match = HUB_REPO.fullmatch(target)
    if match is None or target.startswith((".", "/")) or os.path.lexists(target):
        return None
    leftovers = glob.escape(os.path.join(os.path.dirname(target), "." + os.path.basename(target)))
    if glob.glob(leftovers + ".old-*") or glob.glob(leftovers + ".staging-*"):
        return None
    return HubRepo(match[1], match[2])


def hub_label(repo: HubRepo, snapshot: Path) -> str:
    """`owner/name@<commit>` for the snapshot `snapshot_download` returned: its folder is named by
    the commit it holds, whatever branch or tag was asked for."""
    if COMMIT.fullmatch(snapshot.name):
        return f"{repo.repo_id}@{snapshot.name}"
    return f"{repo.repo_id}@{repo.revision or 'main'} (commit unknown)"


def check_push_target(target: str) -> None:
    """Raise `RuntimeError` now if pushing to `target` cannot work: a Hub repo id needs the Hub
    (not `HF_HUB_OFFLINE`) and a token, a local folder must be replaceable (`check_save_target`)."""
    repo = hub_repo(target)
    if repo is None:
        check_save_target(target)
    elif repo.revision is not None:
        raise RuntimeError(f"--push {target}: push to {repo.repo_id}; a revision (@...) is for --load only")
    else:
        from huggingface_hub import constants, get_token

        if constants.HF_HUB_OFFLINE:
            raise RuntimeError(
                f"--push {target}: the Hub is switched off here (HF_HUB_OFFLINE=1); unset it to push, "
                f"or push into a local folder: ./{target}"
            )
        if get_token() is None:
            raise RuntimeError(
                f"--push {target}: pushing to the Hub needs a token (HF_TOKEN or `hf auth login`); "
                f"to push into a local folder, write it as ./{target}"
            )


def _fetch(source: str, names: list[str]) -> tuple[Path, str, Path | None]:
    """The folder to read, what to call it in the report, and the Hub cache its files may link into.

    A local folder is read as is, after `_tidy` (interrupted saves). A Hub repo: the files of the
    variants `names` at the revision asked for (`owner/name@revision`, else main), downloaded or cached by
    huggingface_hub, called `owner/name@<commit>`: the commit actually loaded.
    """
    repo = hub_repo(source)
    if repo is None:
        _tidy_unless_saving(Path(source).resolve())
        return Path(source), source, None
    from huggingface_hub import snapshot_download

    patterns = [pattern for name in names for pattern in (f"config.{name}.json", f"*.{name}/{PACKAGE}")]
    snapshot = Path(snapshot_download(repo.repo_id, revision=repo.revision, allow_patterns=patterns))
    label = hub_label(repo, snapshot)
    if repo.revision is not None and COMMIT.fullmatch(repo.revision):
        log.info("packages from %s: native code that runs in this process", label)
    else:
        log.warning(
            "packages from %s (%s, not pinned): native code that runs in this process, from whatever was "
            "pushed last; pin the commit you checked with --load %s",
            label,
            repo.revision or "main",
            label,
        )
    return snapshot, label, snapshot.parents[2]  # <cache>/models--owner--name/snapshots/<commit>


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
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo.repo_id, exist_ok=True)
    message = f"Add AoT-compiled blocks of {model}" if model else "Add AoT-compiled blocks"
    commit = api.upload_folder(repo_id=repo.repo_id, folder_path=str(directory), commit_message=message)
    return f"https://huggingface.co/{repo.repo_id} (load it pinned: --load {repo.repo_id}@{commit.oid})"
