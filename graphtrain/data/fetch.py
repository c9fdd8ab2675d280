"""Downloading a dataset's files from its mirrors, checked against their md5 sums.

Each file is tried on $GRAPHTRAIN_MIRROR, then on each mirror in turn, held in memory, checked
against its checksum, and only then written, atomically; nothing is created on disk (not even
the destination folder) before a file has arrived whole and verified. A mirror that cannot be
reached at all is skipped for the remaining files. When files cannot be fetched, one
`DownloadError` says which, and why, mirror by mirror.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from graphtrain import terminal
from graphtrain.data.idx import GZIP_MAGIC, gunzip, read_bytes
from graphtrain.data.registry import DATASETS, ROLES, DatasetSpec, FileSpec, cache_dir, get_spec
from graphtrain.errors import DataError, DownloadError
from graphtrain.files import write_atomic
from graphtrain.terminal import Log

DEFAULT_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------------------------


def verify_file(path: str | os.PathLike[str], file_spec: FileSpec) -> str | None:
    """Check a file (gzipped or not) against its spec's checksums.

    Returns which sum matched ("md5" or "gz_md5"), or None for an uncompressed file whose spec
    only knows the .gz sum, since there is nothing to compare it with. Raises DataError on a
    mismatch, naming the file, the expected and the actual sums.
    """
    path = Path(path)
    return check_sums(read_bytes(path), file_spec, str(path))


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def check_sums(data: bytes, file_spec: FileSpec, label: str) -> str | None:
    """`verify_file` for bytes in memory; `label` names them in the error."""
    mismatches = []
    if data[:2] == GZIP_MAGIC:
        if file_spec.gz_md5:
            actual = _md5(data)
            if actual == file_spec.gz_md5:
                return "gz_md5"
            mismatches.append(f"expected .gz md5 {file_spec.gz_md5}, got {actual}")
        # Only worth decompressing when there is an uncompressed sum to compare with.
        raw = gunzip(data, label) if file_spec.md5 else b""
    else:
        raw = data
    if file_spec.md5:
        actual = _md5(raw)
        if actual == file_spec.md5:
            return "md5"
        mismatches.append(f"expected md5 {file_spec.md5} of the uncompressed data, got {actual}")
    if not mismatches:
        return None
    raise DataError(f"{label}: checksum mismatch: {'; '.join(mismatches)}")


def check_identity(path: str | os.PathLike[str], spec: DatasetSpec, role: str) -> None:
    """Refuse a file that is not `spec`'s `role` file (DataError naming it): one none of whose
    recorded sums matches, or one that is another registered dataset's (an uncompressed
    Fashion-MNIST file, whose own sum is not recorded, is still told apart from MNIST's). A
    copy that cannot be checked against anything (uncompressed, only its .gz sum known, and no
    other dataset's) is accepted: nothing says it is wrong."""
    path = Path(path)
    data = read_bytes(path)

    def sums_match(file_spec: FileSpec) -> bool | None:  # None: nothing to compare with
        try:
            return check_sums(data, file_spec, str(path)) is not None or None
        except DataError:
            return False

    matched = sums_match(spec.files[role])
    if matched:
        return
    what = f"{spec.name}'s {role.replace('_', ' ')}"
    for name, other in DATASETS.items():
        if name != spec.name and sums_match(other.files[role]):
            raise DataError(f"{path} is not {what}: it is {name}'s (its md5 sum is {name}'s); "
                            f"give the folder of the {spec.name} files, or --dataset {name}")
    if matched is False:
        raise DataError(f"{path} is not {what}: its md5 sum matches none recorded for "
                        f"{spec.files[role].name} (another file, or a damaged copy)")


# --------------------------------------------------------------------------------------------
# Fetching
# --------------------------------------------------------------------------------------------


def _mirror_urls(spec: DatasetSpec, mirrors: Sequence[str] | None) -> list[str]:
    bases = list(spec.mirrors if mirrors is None else mirrors)
    # Users behind a proxy or with a local mirror set this; it goes first so the public
    # mirrors are only tried when it fails.
    env = os.environ.get("GRAPHTRAIN_MIRROR", "").strip()
    if env:
        bases.insert(0, env)
    return list(dict.fromkeys(bases))  # drop repeats, keep order


def _url(base: str, name: str) -> str:
    # Mirrors are given as folder URLs; accept them with or without the final slash.
    return (base if base.endswith("/") else base + "/") + name


def _size_text(length: str | None) -> str:
    if length is None or not length.isdigit():
        return "size unknown"
    return f"{int(length) / 1e6:.1f} MB"


class _FetchFailed(Exception):
    """One URL did not give a file; `unreachable`: no connection to its mirror at all (no DNS,
    refused, no answer), so the mirror is skipped from now on."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


def _fetch(base: str, name: str, timeout: float, log: Log) -> bytes:
    url = _url(base, name)
    # A plain name lets mirrors that refuse the default Python agent serve us too.
    request = urllib.request.Request(url, headers={"User-Agent": "graphtrain"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            size = _size_text(response.headers.get("Content-Length"))
            log(f"graphtrain: fetching {name} from {base} ({size})")
            # The largest file is about 30 MB: holding it in memory lets it be verified before
            # anything touches the disk.
            return response.read()
    except urllib.error.HTTPError as exc:
        raise _FetchFailed(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        raise _FetchFailed(f"{url}: {exc.reason}", unreachable=True) from exc
    except TimeoutError as exc:
        raise _FetchFailed(f"{url}: no answer within {timeout:g} s") from exc
    # A dropped connection (OSError), a short read (HTTPException) or a URL urllib cannot
    # open (ValueError) all mean: try the next mirror.
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise _FetchFailed(f"{url}: {exc}") from exc


def _has_valid_copy(dest: Path, file_spec: FileSpec, log: Log) -> bool:
    for path in (dest / file_spec.name, dest / file_spec.raw_name):
        if not path.is_file():
            continue
        try:
            verify_file(path, file_spec)
        except DataError as exc:
            log(f"graphtrain: {exc}; fetching it again")
            return False
        log(f"graphtrain: already have {path}")
        return True
    return False


def download(
    dataset: str | DatasetSpec,
    dest: str | os.PathLike[str] | None = None,
    mirrors: Sequence[str] | None = None,
    log: Log = terminal.log,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Path:
    """Fetch the dataset's files that `dest` (default: the cache) lacks; return `dest`.

    Files already present and valid are kept. A mirror's failure is logged only when another
    mirror then provides the file; otherwise it is in the DownloadError, which lists every file
    no mirror provided.
    """
    spec = get_spec(dataset)
    dest = Path(dest).expanduser() if dest is not None else cache_dir(spec)
    bases = _mirror_urls(spec, mirrors)

    # Keep going after a file fails, so one bad file does not cost the others and the error
    # can list everything still missing.
    failures: dict[str, list[str]] = {}
    # Said once, not per file; and without it, a machine with no network would wait out every
    # timeout once per file.
    unreachable: dict[str, str] = {}
    logged: set[str] = set()  # unreachable mirrors already reported
    for role in ROLES:
        file_spec = spec.files[role]
        if _has_valid_copy(dest, file_spec, log):
            continue
        reasons = []
        for base in bases:
            if base in unreachable:
                continue
            url = _url(base, file_spec.name)
            try:
                data = _fetch(base, file_spec.name, timeout, log)
                check_sums(data, file_spec, url)
            except _FetchFailed as exc:
                if exc.unreachable:
                    unreachable[base] = str(exc)
                else:
                    reasons.append(str(exc))
                continue
            except DataError as exc:  # the mirror served something else
                reasons.append(str(exc))
                continue
            news = [reason for mirror, reason in unreachable.items() if mirror not in logged]
            for reason in [*news, *reasons]:
                log(f"graphtrain: {reason} (fetched from {base} instead)")
            logged.update(unreachable)
            write_atomic(dest / file_spec.name, data)
            break
        else:
            failures[file_spec.name] = reasons

    if failures:
        lines = [f"could not download {len(failures)} of {len(ROLES)} {spec.name} files into {dest}:"]
        lines += [f"  unreachable: {reason}" for mirror, reason in unreachable.items()
                  if mirror not in logged]
        for name, reasons in failures.items():
            lines.append(f"  {name}" + ("" if reasons or unreachable else ": no mirror to download from"))
            lines += [f"    {reason}" for reason in reasons]
        lines.append(
            "Nothing was written for these files. Check the network, set GRAPHTRAIN_MIRROR=URL to "
            "try another mirror, or fetch them by hand and pass --data-dir DIR."
        )
        if unreachable and not any(failures.values()):  # no mirror answered at all
            first = next(iter(unreachable.values()))
            others = len(unreachable) - 1
            summary = f"no mirror could be reached ({first}" + (f"; and {others} other" * (others > 0)) + ")"
        else:
            summary = "\n".join(lines[:-1])
        raise DownloadError("\n".join(lines), summary=summary)
    return dest
