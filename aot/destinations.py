"""Where packages are saved to, pushed to and loaded from: a local folder or a Hub repo
(`owner/name[@revision]`), each checked before any work (a save or push that cannot work is refused
before minutes of compiling)."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, get_token


def check_save_target(target: str | os.PathLike) -> None:
    """Raise `RuntimeError` now if a save cannot replace the folder `target` (before compiling).

    A save builds the new folder beside `target`, renames `target` away and the new one in, then
    deletes the old one (`saving._swap`). So it is refused when `target` is a file; when the folder that
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
