"""Saved packages loaded, verified first: the variant this GPU's trials would compile, a fingerprint
that matches this machine and model, every file inside its folder with the bytes its SHA-256 names.

A package is native code that runs in this process once loaded: its SHA-256 guards against
corruption, not against its publisher (README, Trust). Load only what you control; pin Hub repos
as `owner/name@<commit>`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from huggingface_hub import snapshot_download

from aot import portability
from aot.compiled import BlockPackage, Compiled
from aot.destinations import COMMIT, hub_label, hub_repo
from aot.fa3 import FA3_KERNELS
from aot.fingerprint import differences, fingerprint, variant
from aot.options import FP8_GRANULARITIES, Options
from aot.plans import Decision, Trials, one_line
from aot.resolution import Resolution
from aot.saving import PACKAGE, tidy_unless_saving
from aot.target import Target

log = logging.getLogger("packages")


def load_saved(options: Options, pipe: Any, target: Target, trials: Trials) -> Compiled | None:
    """The packages of `options.load` for `pipe`, where they can be used here (`load_packages`);
    else None, with the reason logged (the caller compiles instead).

    Raises:
        RuntimeError: `options.strict` and they cannot be used, saying why.
    """
    compiled, reason = load_packages(options.load, pipe, target, trials)
    if compiled is None and options.strict:
        raise RuntimeError(f"packages from {options.load} cannot be used: {reason}")
    if compiled is None:
        log.warning("packages from %s not used: %s; compiling", options.load, reason)
    return compiled


def load_packages(source: str, pipe: Any, target: Target, trials: Trials) -> tuple[Compiled | None, str]:
    """Verified packages for `pipe` from a folder or Hub repo: the first variant, in the order of
    `trials` (this GPU's, as a compile here would walk them), whose fingerprint matches `target`'s
    resolution and the model here (`compile_transformer` hands in the `target` and `trials` it
    gives the compile path).

    Returns `(compiled, "")`, or `(None, reason)` with a one-line reason when they cannot be used
    here: no such variant, a malformed config, block classes other than this model's, a fingerprint
    field that differs, a file that is missing, truncated, corrupt or not a regular file inside the
    folder (`_open_inside`). A local folder whose packages group or other users can write is
    loaded with a warning (`_warn_if_writable_by_others`).
    """
    transformer, resolution = pipe.transformer, target.resolution
    candidates = {}  # variant -> fingerprint, in the plan's order: what a compile here would try
    for kernel in trials.attention.steps:
        fa3_kernel = trials.fa3_kernel if kernel in FA3_KERNELS else None
        for granularity in [*trials.fp8.steps, "off"]:
            here = fingerprint(transformer, resolution, kernel, granularity, fa3_kernel, trials.ours)
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
    checks = {"cpu_isa": portability.isa_problem}
    checks.update({name: functools.partial(portability.runtime_problem, name) for name in portability.RUNTIMES})
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
            and meta.get("fp8", "") in (*FP8_GRANULARITIES, None)
        )
        if not ok:
            raise Refused(
                f"{config_name} is malformed: {block} needs bytes (int), sha256 (hex) and fp8 "
                f"({', '.join(FP8_GRANULARITIES)} or null)"
            )
    decisions = config.get("decisions")
    if not isinstance(decisions, list) or not all(
        isinstance(d, list) and len(d) == 3 and all(isinstance(x, str) for x in d) for d in decisions
    ):
        raise Refused(f"{config_name} is malformed: decisions must be [name, value, reason] strings")
    if config.get("fp8_granularity", "") not in (*FP8_GRANULARITIES, None):
        raise Refused(f"{config_name} is malformed: fp8_granularity must be {', '.join(FP8_GRANULARITIES)} or null")


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


def _fetch(source: str, names: list[str]) -> tuple[Path, str, Path | None]:
    """The folder to read, what to call it in the report, and the Hub cache its files may link into.

    A local folder is read as is, after `saving.tidy_unless_saving` (interrupted saves). A Hub repo: the files of the
    variants `names` at the revision asked for (`owner/name@revision`, else main), downloaded or cached by
    huggingface_hub, called `owner/name@<commit>`: the commit actually loaded.
    """
    repo = hub_repo(source)
    if repo is None:
        tidy_unless_saving(Path(source).resolve())
        return Path(source), source, None
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
