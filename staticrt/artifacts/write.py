"""Writing an artifact folder (or a converted checkpoint) so that nothing is lost whatever happens.

The target is checked before any work: an existing path is replaced only when it is an artifact
folder holding nothing its manifest does not list (or an empty folder). `write_folder` builds in
a hidden `.NAME.<pid>.<random>.partial` folder beside the target, gives it the permissions the
umask asks for, and swaps it into place in one atomic rename (Linux `renameat2` exchange; two
renames elsewhere), so the old folder stays whole until the new one is. A failure or SIGTERM
removes the partial folder; one left by a killed process (SIGKILL) is removed by the next write
of the same target, once that process is gone. `write_artifact` adds the hashed, sealed manifest.
Imports no torch.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import ArtifactError, StaticrtError
from .manifest import MANIFEST, SCHEMA_VERSION, seal, sha256


def write_text_atomically(path: Path, text: str) -> None:
    """`path` holds `text` whole or keeps what it held: written beside it, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def check_place(target: Path, option: str, way_out: str, error: type[StaticrtError] = ArtifactError) -> None:
    """Refuse, before any work, a place no folder can be written to as `option`: the current folder
    or one above it (replacing it would pull the floor from under the process), a link (replaced,
    it would be left dangling; followed, it would write elsewhere), a file, a path through a file,
    or a folder this user cannot write in."""
    cwd = Path.cwd().resolve()
    if target.name in ("", ".", "..") or target.resolve() in (cwd, *cwd.parents):
        raise error(f"{option} {str(target)!r} is the current or a parent folder, not a new one; {way_out}")
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        kind = "a symbolic link" if target.is_symlink() else "a file"
        raise error(f"{option} {target} is {kind}, not a folder; {way_out} or remove the {kind.split()[-1]}")
    parent = target.parent
    while not parent.exists() and not parent.is_symlink() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise error(f"{option} {target} lies under {parent}, which is not a folder; {way_out}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{option} {target}: this user cannot write in {parent}; {way_out}")


def check_target(target: Path) -> None:
    """Refuse, before any export work, a target whose replacement would lose something."""
    target = Path(target)
    way_out = "choose another --out (a new folder, or an artifact folder to replace)"
    if target.is_file() and not target.is_symlink():
        raise ArtifactError(f"--out {target} is a file, not an artifact folder; {way_out} or remove the file")
    check_place(target, "--out", way_out)
    if not target.is_dir():
        return
    held = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if not p.is_dir())
    if not held:
        return
    manifest = target / MANIFEST
    try:
        listed = set(json.loads(manifest.read_text())["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        raise ArtifactError(
            f"--out {target} exists and is not an artifact folder (it holds {held[:5]}"
            f"{' ...' if len(held) > 5 else ''}); {way_out}, or move its contents away first"
        ) from None
    foreign = [name for name in held if name not in listed]
    if foreign:
        raise ArtifactError(
            f"--out {target} is an artifact folder that also holds file(s) {foreign[:5]} its manifest does not "
            f"list; replacing it would delete them: move them out of the folder or {way_out}"
        )


def write_folder(target: Path, build: Callable[[Path], None], error: type[StaticrtError] = ArtifactError) -> Path:
    """Run `build(folder)`, which writes the files into `folder`, and swap the folder into `target`.

    Nothing appears at `target` unless `build` finishes; on any failure (SIGTERM included) the
    partial folder is removed and the error propagates. The caller has checked `target`
    (`check_place`); a place the file system still refuses is an `error` naming it.
    """
    target = Path(target)
    with _terminate_raises() as armed:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(target)
            work = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".partial", dir=target.parent))
        except OSError as err:
            raise error(f"cannot write {target} ({err.strerror}); choose a folder on a writable disk") from None
        try:
            armed()
            build(work)
            _apply_umask(work)
            _swap_into_place(work, target)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return target


def write_artifact(target: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Check `target`, then run `build(folder)`, which writes the artifact's files into `folder` and
    returns the manifest's fields; hash every file and write the sealed manifest (`write_folder`)."""
    check_target(target)

    def build_sealed(work: Path) -> None:
        fields = build(work)
        files = sorted(p for p in work.rglob("*") if p.is_file())
        manifest = {
            "schema_version": SCHEMA_VERSION,
            **fields,
            "files": {p.relative_to(work).as_posix(): sha256(p) for p in files},
        }
        (work / MANIFEST).write_text(json.dumps(seal(manifest), indent=2) + "\n")

    return write_folder(target, build_sealed)


def remove_stale(target: Path) -> None:
    """Remove what an export of `target` killed outright left beside it: its partial folder, and
    an old artifact set aside mid-swap (restored to `target` when nothing took its place)."""
    target = Path(target)
    leftover = re.compile(rf"^\.{re.escape(target.name)}\.(\d+)\.(?:[a-z0-9_]+\.partial|replaced)$")
    for path in sorted(target.parent.iterdir()):
        match = leftover.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        if path.name.endswith(".replaced") and not target.exists():
            path.rename(target)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextmanager
def _terminate_raises() -> Iterator[Callable[[], None]]:
    """SIGTERM (and SIGHUP) raise SystemExit inside the block, so the cleanup above runs.

    The handler goes in before the partial folder exists, and a signal is held until the caller
    calls the yielded `armed()` (once `work` names the folder): one arriving inside mkdtemp, after
    its mkdir, would otherwise kill the process or raise before anything could remove the folder.
    Python runs handlers in the main thread between bytecodes, so the flag needs no lock.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    state: dict[str, Any] = {"armed": False, "pending": None}

    def raise_exit(signum: int, frame: Any) -> None:
        if not state["armed"]:
            state["pending"] = signum
            return
        raise SystemExit(128 + signum)

    def armed() -> None:
        state["armed"] = True
        if state["pending"] is not None:
            raise SystemExit(128 + state["pending"])

    previous = {sig: signal.signal(sig, raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield armed
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if state["pending"] is not None and not state["armed"]:
            signal.raise_signal(state["pending"])  # held through a failure before `work`: sent on


def _apply_umask(folder: Path) -> None:
    """mkdtemp makes 0700 folders and some writers 0600 files; an artifact is shared like any output.
    A file its writer made executable (a built program) stays executable."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        runs = path.is_dir() or path.stat().st_mode & 0o100
        path.chmod((0o777 if runs else 0o666) & ~umask)


def _swap_into_place(work: Path, target: Path) -> None:
    """`work` becomes `target`; an old `target` is deleted only once the new one is in place."""
    if not target.exists():
        work.rename(target)
        return
    if _exchange(work, target):
        shutil.rmtree(work)  # now the old artifact
        return
    old = target.with_name(f".{target.name}.{os.getpid()}.replaced")
    target.rename(old)
    work.rename(target)
    shutil.rmtree(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where the OS cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
