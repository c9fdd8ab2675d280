"""Files graphtrain writes: checked before the work, written atomically, cached in one place.

    check_writable(path)     before training: can the results be written there? (UsageError)
    check_outputs(outs, ins) before training: each output writable, none an input or another output
    read_input(path, error)  an input's bytes, or one line saying why not
    write_atomic(path, data) after: the whole file or nothing (OutputError on an OSError)
    cache_dir(name)          graphtrain's per-user cache folder `name` (datasets, kernels)
    write_cached(path, ...)  a cache entry whose corruption read_cached detects

An atomic write goes to a temporary file beside the target and is renamed over it, so a reader
(or a crash, or Ctrl-C) sees the old file or the new one, never half of one. A target that
exists and is not a regular file is not replaced: a symbolic link is followed, and a device or a
FIFO (/dev/null, a named pipe) is written through.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from graphtrain.errors import OutputError, UsageError

Content = bytes | str | Callable[[BinaryIO], None]  # a callable writes the content to the file


def cache_dir(name: str) -> Path:
    """The per-user cache folder `name`: $XDG_CACHE_HOME/graphtrain/<name>, or
    ~/.cache/graphtrain/<name> (a relative XDG_CACHE_HOME is ignored, as the XDG spec says)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "graphtrain" / name


def write_cached(path: Path, magic: bytes, payload: bytes) -> bool:
    """Keep `payload` at `path` as magic + sha256(payload) + payload, atomically. A cache is an
    optimisation: False, not an error, when it cannot be written (a read-only home, a full disk)."""
    try:
        write_atomic(path, magic + hashlib.sha256(payload).digest() + payload)
    except OutputError:
        return False
    return True


def read_cached(path: Path, magic: bytes) -> bytes | None:
    """The payload `write_cached` kept at `path`, or None when absent, unreadable or corrupt."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    header = len(magic) + hashlib.sha256().digest_size
    payload, digest = blob[header:], blob[len(magic):header]
    ok = blob.startswith(magic) and payload and hashlib.sha256(payload).digest() == digest
    return payload if ok else None


def _existing_ancestor(path: Path) -> Path:
    for folder in path.parents:
        if os.path.lexists(folder):
            return folder
    return Path(path.anchor or ".")


def _probe_folder(folder: Path) -> str | None:
    """Why a new file cannot be created in `folder`, or None when it can (tried, not guessed)."""
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".graphtrain-check.")
    except OSError as exc:
        return f"cannot create a file in {folder} ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(name)
    return None


def check_writable(path: str | os.PathLike[str], folder: bool = False) -> None:
    """Raise UsageError("cannot write PATH: reason") unless `path` can be written: a file, or
    with `folder=True` a folder to write files into. Missing parent folders are fine when they
    can be created. "-" (standard output) is always writable."""
    if str(path) == "-":
        return
    path = Path(path).expanduser()
    reason = None
    if path.exists():
        target = path.resolve()
        mode = target.stat().st_mode
        if folder:
            reason = None if stat.S_ISDIR(mode) else f"{path} is not a folder"
            reason = reason or _probe_folder(target)
        elif stat.S_ISDIR(mode):
            reason = f"{path} is a folder"
        elif stat.S_ISREG(mode):
            reason = _probe_folder(target.parent)
        elif not os.access(target, os.W_OK):  # a device or a FIFO, written through
            reason = "permission denied"
    else:  # written after creating the missing folders below the nearest existing one
        reason = _probe_folder(_existing_ancestor(path))
    if reason:
        raise UsageError(f"cannot write {path}: {reason}")


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same path once resolved (links followed, whether or
    not it exists yet), or one existing file by two names (a hard link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist yet: different files
        return False


def _written_through(path: Path) -> bool:
    """A device or a FIFO (/dev/null, a named pipe): written through, never replaced, so two
    outputs may share it."""
    try:
        return not stat.S_ISREG(path.stat().st_mode) and not stat.S_ISDIR(path.stat().st_mode)
    except OSError:
        return False


def check_outputs(outputs: dict[str, str | os.PathLike[str] | None],
                  inputs: dict[str, str | os.PathLike[str] | None] | None = None) -> None:
    """Before any work: UsageError unless every output (option -> path; None: not asked for) can
    be written (check_writable) and none is the same file as an input (which writing it would
    destroy) or as another output (which would leave only one of the two). '-' is standard
    output, never a file."""
    given = {option: Path(path).expanduser() for option, path in outputs.items()
             if path is not None and str(path) != "-"}
    sources = {option: Path(path).expanduser() for option, path in (inputs or {}).items() if path is not None}
    seen: dict[str, Path] = {}
    for option, path in given.items():
        for other, source in sources.items():
            if _same_file(path, source):
                raise UsageError(f"{option} {path} is the same file as {other}: writing it would destroy that "
                                 "input; give another path")
        for other, earlier in seen.items():
            if _same_file(path, earlier) and not _written_through(path):
                raise UsageError(f"{option} and {other} name the same file, {path}: give each its own path")
        seen[option] = path
    for path in given.values():
        check_writable(path)


def read_input(path: Path, error: type[UsageError] = UsageError, size: int = -1) -> bytes:
    """The bytes of an input file (its first `size` bytes when given), or `error` in one line
    saying why it cannot be read."""
    try:
        with open(path, "rb") as handle:
            return handle.read(size)
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a file") from None
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}") from exc


def write_json(path: str | os.PathLike[str], obj) -> Path:
    """`obj` as indented JSON, atomically (see `write_atomic`)."""
    # default=str: a stray Path or numpy scalar becomes text rather than a half-written file.
    return write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def _write_content(handle: BinaryIO, content: Content) -> None:
    if callable(content):
        content(handle)
    else:
        handle.write(content.encode("utf-8") if isinstance(content, str) else content)


def write_atomic(path: str | os.PathLike[str], content: Content) -> Path:
    """Write `content` (bytes, text as UTF-8, or a callable writing into a binary file) to
    `path`, creating missing parent folders; returns the path written.

    A regular file is replaced atomically; a symbolic link is followed to its target; a device
    or FIFO is written through. Any OSError becomes an OutputError naming the path.
    """
    path = Path(path).expanduser()
    try:
        target = path.resolve() if path.is_symlink() else path
        if target.exists() and not target.is_file():
            if target.is_dir():
                raise OutputError(f"cannot write {path}: it is a folder")
            with open(target, "wb") as handle:  # /dev/null, a named pipe: no rename possible
                _write_content(handle, content)
            return path
        target.parent.mkdir(parents=True, exist_ok=True)
        _replace(target, content)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


def _replace(target: Path, content: Content) -> None:
    # Same folder as the target, so os.replace is a rename within one file system.
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    temp = Path(temp_name)
    replaced = False
    try:
        with os.fdopen(fd, "wb") as handle:
            _write_content(handle, content)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp makes files readable by their owner only; give the file the mode any new file
        # of the user's gets: 0666 less the umask.
        os.chmod(temp, 0o666 & ~_umask())
        os.replace(temp, target)
        replaced = True
    finally:
        # Whatever stopped us (a full disk, Ctrl-C), no half-written file stays behind.
        if not replaced:
            temp.unlink(missing_ok=True)
    _fsync_folder(target.parent)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    # Makes the rename itself durable; not possible on every platform, and not essential.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
