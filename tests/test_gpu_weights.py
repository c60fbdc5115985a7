"""benchmarks/gpu_weights.py: split / join round trip, and the named errors for a missing or corrupt piece."""

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_weights as gw  # noqa: E402


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(100_003))  # not a multiple of the piece count
    return path


def test_round_trip_is_byte_identical(src, tmp_path):
    xfer = tmp_path / "xfer"
    m = gw.split(src, xfer, pieces=3, max_mib=0.05)
    assert [p["path"] for p in m["pieces"]] == [f"p{i}/model.gguf.part{i}" for i in (1, 2, 3)]
    assert sum(p["size"] for p in m["pieces"]) == 100_003 and max(p["size"] for p in m["pieces"]) <= 0.05 * gw.MIB
    for i in (1, 2, 3):  # each piece folder travels alone, so each holds the manifest
        assert json.loads((xfer / f"p{i}" / gw.MANIFEST).read_text()) == m
    (xfer / gw.MANIFEST).unlink()  # as on the GPU machine, where only the piece folders arrive
    out = gw.join(xfer, tmp_path / "joined" / "model.gguf")
    assert out.read_bytes() == src.read_bytes()
    assert not [p for p in out.parent.iterdir() if p.name != "model.gguf"]  # no temporary file left behind
    assert gw.main(["join", "--dir", str(xfer), "--out", str(out)]) == 0  # already there and verified


def test_missing_piece_is_named_with_the_fix(src, tmp_path, capsys):
    xfer = tmp_path / "xfer"
    gw.split(src, xfer, pieces=3, max_mib=1)
    for f in (xfer / "p2").iterdir():
        f.unlink()
    (xfer / "p2").rmdir()
    with pytest.raises(gw.TransferError, match=r"missing piece 2 of 3 .*carry \.xfer/p2"):
        gw.join(xfer)
    assert not (xfer / "model.gguf").exists()
    assert gw.main(["join", "--dir", str(xfer)]) == 1
    assert "piece 2 of 3" in capsys.readouterr().err


def test_corrupt_piece_is_named_and_nothing_is_written(src, tmp_path):
    xfer = tmp_path / "xfer"
    gw.split(src, xfer, pieces=3, max_mib=1)
    piece = xfer / "p3" / "model.gguf.part3"
    data = bytearray(piece.read_bytes())
    data[10] ^= 0xFF
    piece.write_bytes(bytes(data))
    with pytest.raises(gw.TransferError, match=r"piece 3 of 3 .* is corrupt.*carry \.xfer/p3 again"):
        gw.join(xfer)
    assert sorted(p.name for p in xfer.iterdir()) == [gw.MANIFEST, "p1", "p2", "p3"]


def test_piece_size_limit_and_no_manifest(src, tmp_path):
    with pytest.raises(ValueError, match="--pieces=3"):
        gw.split(src, tmp_path / "x", pieces=1, max_mib=0.04)
    with pytest.raises(gw.TransferError, match="no manifest.json"):
        gw.join(tmp_path / "empty")
