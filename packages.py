"""Compiled packages on disk and on the Hub: save, verify, load, push.

Layout (what `spaces.aoti_blocks_load(transformer, repo_id, variant=...)` reads):

    DIR/config.<variant>.json                 kernels to load first, the fingerprint, per-class metadata
    DIR/<BlockClass>.<variant>/package.pt2    one weights-less AOTInductor package per block class

The variant names the graph-changing choices, e.g. `fa3-fp8row-512-1536`. The fingerprint
records what a package is valid for: library versions, CPU architecture, CUDA and compute
capability, dtype, size range, attention and FP8 choices, and per block class its forward signature
and weight names, shapes and dtypes; plus the CPU vector ISA its C++ was built for. A package is
used only when every field matches here, this CPU has that ISA, and its bytes match the recorded
SHA-256, so a stale, truncated or foreign package never reaches the native loader.
A save writes the new set beside the folder and swaps it in with two renames, so no reader sees a
half-written set.
Neither weights nor tokens are written. (AOTInductor itself embeds its build command, with the
build machine's include paths, in each package's sources and debug info.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blocks import BlockPackage, Compiled, dtype_name, forward_signature, repeated_blocks
from fast_paths import FA3_KERNEL_VERSION, Decision, resolve_attention, resolve_fp8
from options import Options, Resolution

log = logging.getLogger("packages")
SCHEMA = 2
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
        # Each package holds C++ for this architecture; `compile_blocks` adds the vector ISA ("cpu_isa").
        "machine": platform.machine(),
        "dtype": dtype_name(transformer.dtype),
        "sizes": [resolution.min_side, resolution.max_side, resolution.step],
        "attention": attention.value,
        "fa3_kernel": options.fa3_kernel if attention.value == "fa3" else None,
        "fp8": options.fp8_granularity if fp8.value == "on" else "off",
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
        if key in ("blocks", "cpu_isa"):  # cpu_isa: a property of the packages, see cpu_isa_problem
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


def cpu_isa_problem(cpu_isa: str) -> str | None:
    """Why this CPU cannot run C++ built for `cpu_isa` (Inductor's vector ISA at compile time, e.g.
    `avx512 avx512_vnni`), or None.

    Torch's own rule for a usable ISA (`cpu_vec_isa.valid_vec_isa_list`): every flag of it is in
    `x86_isa_checker()`, which asks the CPU (under a millisecond; no test builds). Other
    architectures have no finer names than the architecture, which the fingerprint compares.
    """
    from torch._inductor.cpu_vec_isa import x86_isa_checker

    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    have = x86_isa_checker()
    missing = [flag for flag in cpu_isa.split() if flag not in have]
    if missing:
        return f"the packages were built for CPU ISA {cpu_isa!r}; this CPU lacks {', '.join(missing)}"
    return None


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
    """
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


def _swap(directory: Path, fill: Callable[[Path], None]) -> None:
    """Replace `directory` by a new version of it, so that no reader sees a half-written set.

    `fill(staging)` writes the new entries into a staging folder beside `directory`; entries of the
    old folder that `fill` did not write are carried over as hard links (never written through).
    Two renames then swap the folders. An interruption before them leaves the old folder as it
    was; one between them leaves it as `.<name>.old-*`, which `_recover` puts back.
    """
    _recover(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    for stale in directory.parent.glob(f".{directory.name}.staging-*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.staging-", dir=directory.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        fill(staging)
        if directory.is_dir():
            for entry in directory.iterdir():
                if not (staging / entry.name).exists():
                    if entry.is_dir():
                        shutil.copytree(entry, staging / entry.name, copy_function=os.link)
                    else:
                        os.link(entry, staging / entry.name)
        previous = directory.with_name(f".{directory.name}.old-{uuid.uuid4().hex[:8]}")
        if directory.exists():
            os.rename(directory, previous)
        os.rename(staging, directory)
        shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _recover(directory: Path) -> None:
    """Put back the previous set if a save stopped between its two renames."""
    olds = sorted(directory.parent.glob(f".{directory.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not directory.exists():
        os.rename(olds[-1], directory)
        log.warning("%s was missing after an interrupted save; restored the previous packages", directory)


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


def load_packages(source: str, pipe: Any, options: Options) -> tuple[Compiled | None, str]:
    """Verified packages for `pipe` under `options` from a folder or Hub repo.

    Returns `(compiled, "")`, or `(None, reason)` when they cannot be used here: no such variant,
    a fingerprint field that differs, a missing, truncated or corrupt file.

    Raises:
        RuntimeError: a fast path explicitly requested in `options` cannot run here.
    """
    transformer = pipe.transformer
    resolution = options.resolution(pipe.vae_scale_factor)
    attention = resolve_attention(options, transformer, transformer.device)
    fp8 = resolve_fp8(options, transformer.device)
    here = fingerprint(transformer, resolution, attention, fp8, options)
    name = variant(here)
    try:
        folder = _fetch(source, name)
    except Exception as exc:  # network, auth, no such repo
        return None, f"cannot read {source}: {type(exc).__name__}: {exc}"
    config_path = folder / f"config.{name}.json"
    if not config_path.is_file():
        found = sorted(p.name for p in folder.glob("config.*.json")) if folder.is_dir() else []
        return None, f"no {config_path.name} in {source} (found: {', '.join(found) or 'nothing'})"
    try:
        config = json.loads(config_path.read_text())
        saved = config["fingerprint"]
    except (ValueError, KeyError) as exc:
        return None, f"{config_path.name} is unreadable: {exc}"
    diff = differences(saved, here)
    if diff:
        return None, "fingerprint differs: " + "; ".join(diff[:3])
    if "cpu_isa" not in saved:
        return None, f"{config_path.name} records no cpu_isa"
    problem = cpu_isa_problem(saved["cpu_isa"])
    if problem:
        return None, problem
    packages = {}
    for block, meta in config["blocks"].items():
        path = folder / f"{block}.{name}" / PACKAGE
        if not path.is_file():
            return None, f"{path.relative_to(folder)} is missing"
        data = path.read_bytes()
        if len(data) != meta["bytes"]:
            return None, f"{path.relative_to(folder)} has {len(data)} bytes, {meta['bytes']} were saved (truncated?)"
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            return None, f"{path.relative_to(folder)} does not match its SHA-256 (corrupt)"
        packages[block] = BlockPackage.from_metadata(block, data, meta, resolution)
    decisions = [Decision(*d) for d in config["decisions"]]
    return Compiled(
        packages, decisions, resolution, here["fa3_kernel"], config["fp8_granularity"], saved, f"loaded from {source}"
    ), ""


def _is_hub_repo(target: str) -> bool:
    """`owner/name` that is not an existing path; `./x`, `/x`, `x` and `x/y/z` are folders."""
    return not Path(target).exists() and not target.startswith((".", "/")) and target.count("/") == 1


def check_push_target(target: str) -> None:
    """Raise `RuntimeError` now if pushing to `target` cannot work: a Hub repo id needs a token."""
    if _is_hub_repo(target):
        from huggingface_hub import get_token

        if get_token() is None:
            raise RuntimeError(
                f"--push {target}: pushing to the Hub needs a token (HF_TOKEN or `hf auth login`); "
                f"to push into a local folder, write it as ./{target}"
            )


def _fetch(source: str, name: str) -> Path:
    """A local folder as is; otherwise the variant's files of a Hub repo (cached by huggingface_hub)."""
    if not _is_hub_repo(source):
        _recover(Path(source).resolve())
        return Path(source)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, allow_patterns=[f"config.{name}.json", f"*.{name}/{PACKAGE}"]))


def push_packages(directory: str | os.PathLike, target: str) -> str:
    """Publish a saved folder to a Hub repo id (one commit; token from HF_TOKEN) or a local folder.

    A local target is updated with `save_packages`'s atomic swap. Returns where the packages went.
    """
    directory = Path(directory)
    if not _is_hub_repo(target):
        destination = Path(target).resolve()
        _swap(destination, lambda staging: shutil.copytree(directory, staging, dirs_exist_ok=True))
        return str(destination)
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(target, exist_ok=True)
    api.upload_folder(repo_id=target, folder_path=str(directory), commit_message="Add AoT-compiled FLUX blocks")
    return f"https://huggingface.co/{target}"
