"""Files on disk: which local files a dataset name means, and writes that never leave a partial file."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .errors import ConfigError

# a heads directory: what `DraftHeads.save_pretrained` writes
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".txt", ".csv", ".arrow")


def looks_local(name: str) -> bool:
    """A name we should find on disk rather than on the hub: explicit paths, data files, globs."""
    return (name.startswith(("/", "./", "../", "~")) or name.lower().endswith(DATA_SUFFIXES + (".gguf",))
            or any(c in name for c in "*?[") or os.sep + os.sep in name)


def local_data_files(dataset: str) -> list[str] | None:
    """The files `dataset` names on disk (a file, a directory of data files, or a glob), or None for a
    hub name. Raises ConfigError when it clearly names local files that are not there."""
    path = Path(os.path.expanduser(dataset))
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
        if not files:
            raise ConfigError(f"data.dataset: directory {dataset} holds no json/jsonl/parquet/txt/csv files")
        return files
    if any(c in dataset for c in "*?["):
        files = sorted(glob.glob(os.path.expanduser(dataset), recursive=True))
        if not files:
            raise ConfigError(f"data.dataset: glob {dataset} matches no files")
        return files
    if looks_local(dataset):
        raise ConfigError(f"data.dataset: file not found: {dataset}")
    return None


def is_heads_dir(path: str | os.PathLike) -> bool:
    """Whether `path` holds trained heads (config.json and model.safetensors)."""
    return (Path(path) / CONFIG_NAME).is_file() and (Path(path) / WEIGHTS_NAME).is_file()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# the permissions a file created the ordinary way gets (safetensors writes its files 0600: private to their owner,
# so another user of a shared machine could not load the heads)
FILE_MODE = 0o666 & ~_umask()


HOST = socket.gethostname()
TEMP_MARK = ".tmp-"  # an atomic write's temp file: `.NAME.tmp-HOST-PID`, beside its final name
STALE_TEMP_SECONDS = 24 * 3600  # a temp file of another machine's this old is a dead writer's


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's entries') data to the disk. A file system that cannot sync a directory
    (some network ones) is let be."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not Path(path).is_dir():
            raise
    finally:
        os.close(fd)


def temp_path(final: Path) -> Path:
    """Where `atomic_write` stages `final`: named by this machine and process, so that a dead writer's file can be
    told from a live one's (`remove_stale_temps`)."""
    return final.with_name(f".{final.name}{TEMP_MARK}{HOST}-{os.getpid()}")


def atomic_write(final: str | os.PathLike, write: Callable[[str], object]) -> None:
    """Write `final` through `write(tmp_path)`, an fsync and a rename (then an fsync of the directory), so that
    neither a crash nor a power loss leaves a partial file under the final name; the file gets the ordinary
    permissions (`FILE_MODE`), whatever the writer created it with. A failed write removes its temp file."""
    final = Path(final)
    tmp = temp_path(final)
    try:
        write(str(tmp))
        os.chmod(tmp, FILE_MODE)
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(final.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temps(directory: str | os.PathLike) -> int:
    """Remove the temp files that killed writers left in `directory` (a kill -9 runs no cleanup): those of this
    machine whose process is gone, and any a day old (another machine's, on a shared file system). A live writer's,
    here or elsewhere, is left alone. Returns how many were removed."""
    removed = 0
    for f in Path(directory).glob(f".*{TEMP_MARK}*"):
        if not f.is_file():
            continue
        owner = f.name.rsplit(TEMP_MARK, 1)[1]
        host, _, pid = owner.rpartition("-")  # (files named before the host was: `.NAME.tmp-PID`, host "")
        try:
            dead = host in ("", HOST) and pid.isdigit() and not _alive(int(pid))
            if dead or time.time() - f.stat().st_mtime > STALE_TEMP_SECONDS:
                f.unlink()
                removed += 1
        except FileNotFoundError:  # another process removed it first, or its writer renamed it into place
            continue
    return removed


def ordinary_modes(directory: Path) -> None:
    """Give a staged directory and everything in it the permissions ordinary files and folders get: mkdtemp makes
    the directory 0700 and safetensors writes its files 0600, which would hide exported or prepared models from the
    other users of a shared machine."""
    for path in [directory, *directory.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, 0o777 & ~_umask() if path.is_dir() else FILE_MODE)


def atomic_write_dir(final: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Write the directory `final` through `write(staging)` into a directory beside it, then rename it into place,
    replacing what was there: `final` is always the old directory or the whole new one. A failed `write` leaves
    nothing behind. Returns `final`."""
    final = Path(final)
    parent = final.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=parent))
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    ordinary_modes(staging)
    if final.exists():
        old = final.with_name(f".{final.name}.replaced-{os.getpid()}")
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    return final


def atomic_write_text(final: str | os.PathLike, text: str) -> None:
    """`atomic_write` for a text file."""
    atomic_write(final, lambda tmp: Path(tmp).write_text(text))


def write_json(path: str | os.PathLike, obj: object) -> None:
    """A results file: its directory made if needed, written atomically, indented, with a final newline."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def cache_root() -> Path:
    """`$MEDUSA_TRAIN_CACHE`, else `~/.cache/medusa-train`."""
    env = os.environ.get("MEDUSA_TRAIN_CACHE")
    return Path(os.path.expanduser(env)) if env else Path.home() / ".cache" / "medusa-train"
