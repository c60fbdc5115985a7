"""``from_pretrained`` / ``load_tokenizer``: dispatch on an HF directory, a .gguf file or a preset alias.

De-quantising a GGUF costs seconds, so its float32 weights (our own layout, safetensors) and its tokenizer are
cached under ``cache_dir()/weights`` keyed by the file's path, size and mtime; a second load reads them instead.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from tlt_jax.models import presets
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.gguf_io import load_gguf, open_gguf
from tlt_jax.models.hf_io import CONFIG_FILE, load_hf
from tlt_jax.models.tokenizer import Tokenizer, tokenizer_from_gguf_reader, tokenizer_from_hf_dir
from tlt_jax.models.transformer import CausalLM
from tlt_jax.models.weights import (
    ModelLoadError,
    config_from_json,
    config_to_json,
    flat_params,
    model_from_arrays,
)

_CACHE_FORMAT = "tlt_jax.params.v1"


def _kind(path: Path) -> str:
    if path.is_dir():
        if not (path / CONFIG_FILE).exists():
            raise ModelLoadError(f"{path}: directory has no {CONFIG_FILE} (expected an HF model directory)")
        return "hf"
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory (and not a known alias: {sorted(presets.ALIASES)})")
    raise ModelLoadError(f"{path}: expected an HF model directory or a .gguf file")


def cache_key(path: Path) -> str:
    """Cache entry name for a file: its stem plus a hash of (real path, size, mtime)."""
    st = path.stat()
    h = hashlib.sha256(f"{_CACHE_FORMAT}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{h}"


def _cache_paths(path: Path) -> tuple[Path, Path]:
    base = presets.cache_dir() / "weights"
    key = cache_key(path)
    return base / f"{key}.safetensors", base / f"{key}.tokenizer.json"


def _atomic_write(target: Path, write) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load_cached(file: Path, dtype, param_dtype) -> CausalLM | None:
    """The model from a weight-cache file, or None if the file is absent or not a valid cache entry."""
    if not file.is_file():
        return None
    try:
        with safe_open(str(file), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _CACHE_FORMAT:
                return None
            cfg = config_from_json(meta["config"])
            return model_from_arrays(cfg, lambda path, _: f.get_tensor(".".join(path)), dtype, param_dtype)
    except Exception:  # a truncated or stale entry is rebuilt from the source file
        return None


def _save_cache(model: CausalLM, file: Path) -> None:
    tensors = {k: v.astype(np.float32) for k, v in flat_params(model).items()}
    meta = {"format": _CACHE_FORMAT, "config": config_to_json(model.config)}
    _atomic_write(file, lambda tmp: save_file(tensors, tmp, metadata=meta))


def from_pretrained(
    path: str | os.PathLike, dtype=jnp.float32, param_dtype=None, *, cache: bool = True, mesh=None
) -> CausalLM:
    """Load a CausalLM from an HF directory, a .gguf file or an alias (``presets.DEFAULT_MODEL``).

    ``dtype`` is the compute dtype; ``param_dtype`` (default: ``dtype``) the stored parameter dtype. GGUF weights are
    de-quantised to float32 and cached (``cache=False`` skips the cache). With ``mesh``, an HF directory is read
    shard by shard straight into the mesh's parameter shardings (see ``load_hf``); other formats load whole.
    """
    path = presets.resolve(path)
    dtype = jnp.dtype(dtype)
    param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
    if _kind(path) == "hf":
        return load_hf(path, dtype, param_dtype, mesh=mesh)
    if not cache:
        return load_gguf(path, dtype, param_dtype)
    file, _ = _cache_paths(path)
    model = _load_cached(file, dtype, param_dtype)
    if model is None:
        model = load_gguf(path, dtype, jnp.float32)
        _save_cache(model, file)
        if param_dtype != jnp.float32:
            model = _load_cached(file, dtype, param_dtype)
    return model


def load_tokenizer(path: str | os.PathLike, *, cache: bool = True) -> Tokenizer:
    """The tokenizer of an HF directory (tokenizer.json), a .gguf file (embedded BPE) or an alias."""
    path = presets.resolve(path)
    if _kind(path) == "hf":
        return tokenizer_from_hf_dir(path)
    _, file = _cache_paths(path)
    if cache and file.is_file():
        try:
            return Tokenizer.from_json(file.read_text())
        except Exception:  # stale entry: rebuild below
            pass
    tok = tokenizer_from_gguf_reader(open_gguf(path), str(path))
    if cache:
        _atomic_write(file, lambda tmp: Path(tmp).write_text(tok.to_json()))
    return tok


def check_tokenizer_matches(tokenizer: Tokenizer, config: ModelConfig) -> None:
    """Raise ModelLoadError if the tokenizer can produce ids the model's embedding has no row for."""
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"tokenizer {tokenizer.source!r} has {tokenizer.vocab_size} tokens but the model's embedding has "
            f"{config.vocab_size} rows (vocab mismatch): ids >= {config.vocab_size} have no embedding; "
            f"the tokenizer does not belong to this model"
        )
    bad = [t for t in tokenizer.eos_token_ids if t >= config.vocab_size]
    if bad:
        raise ModelLoadError(f"tokenizer {tokenizer.source!r}: eos ids {bad} >= model vocab {config.vocab_size}")


def load_model_and_tokenizer(
    path: str | os.PathLike,
    dtype=jnp.float32,
    param_dtype=None,
    *,
    tokenizer_path: str | os.PathLike | None = None,
    mesh=None,
) -> tuple[CausalLM, Tokenizer]:
    """Model and tokenizer (from ``tokenizer_path`` or the model's own path), checked to belong together."""
    model = from_pretrained(path, dtype, param_dtype, mesh=mesh)
    tok = load_tokenizer(path if tokenizer_path is None else tokenizer_path)
    check_tokenizer_matches(tok, model.config)
    return model, tok
