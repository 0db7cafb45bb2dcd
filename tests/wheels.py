"""Source files of a package's released wheel, read by tests for engines that do not run here (SGLang; vLLM
releases without a CPU build): downloaded once (no dependencies, nothing imported) into the project's cache, staged
and renamed into place, so an interrupted download never leaves a folder a later run would trust."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from medusa_train.base.files import cache_root


def wheel_source(project: str, version: str, needed: tuple[str, ...]) -> Path:
    """The folder holding the `.py` files of `project==version`'s wheel whose paths start with one of `needed` (a
    file's path, or a folder's ending in /)."""
    where = cache_root() / f"{project}-{version}-source"
    if all((where / name).exists() for name in needed):
        return where
    staging = where.with_name(f".{where.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary", ":all:", "--dest", str(staging / "wheel"), f"{project}=={version}"],
                       check=True)
        (wheel,) = (staging / "wheel").glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(needed) and name.endswith(".py"):
                    z.extract(name, staging)
        shutil.rmtree(staging / "wheel")
        shutil.rmtree(where, ignore_errors=True)
        os.replace(staging, where)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return where
