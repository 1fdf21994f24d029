"""Another triton release than the installed one, pip-installed once into a cache folder of its own, for a
subprocess to put first on its sys.path (tests/kernels/test_gpu_compile.py compiles the kernels with it).

The folder is ~/.cache/archzoo/triton-VERSION ($XDG_CACHE_HOME in place of ~/.cache where set). pip installs into
a `.partial` folder beside it that is renamed when pip has finished, so the folder exists only whole; a file lock
keeps two installs apart, and under it a `.partial` folder left over is an install that was cut off.
"""
import fcntl
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

PIP_TIMEOUT_S = 900  # a ~170 MB wheel from PyPI on a slow link


class InstallError(RuntimeError):
    pass


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "archzoo"


@contextmanager
def exclusive(lock_path: Path):
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def triton_folder(version: str) -> Path:
    """A folder holding triton==version and nothing else, installed on the first call."""
    folder = cache_folder() / f"triton-{version}"
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(folder.with_name(f"{folder.name}.lock")):
        if not folder.is_dir():  # another process may have installed it while this one waited
            install(version, folder)
    return folder


def install(version: str, folder: Path) -> None:
    partial = folder.with_name(f"{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    # --no-deps: triton's wheels need nothing else on Python 3.10 and later
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary", ":all:", "--target", str(partial), f"triton=={version}"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise InstallError(f"pip did not install triton=={version} in {PIP_TIMEOUT_S} s") from error
    if result.returncode != 0:
        raise InstallError(f"pip could not install triton=={version} from PyPI into {partial} "
                           f"(exit {result.returncode}):\n{result.stderr[-2000:]}")
    partial.rename(folder)
