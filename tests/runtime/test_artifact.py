"""Artifact format v1: round trips (directory and zip), byte-identical output, and every refusal."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from m3c.errors import ArtifactError
from m3c.runtime.artifact import (
    GRAPH,
    MANIFEST,
    WEIGHTS,
    artifact_files,
    load_artifact,
    read_manifest,
    save_artifact,
    sha256_bytes,
    verify_artifact,
    write_artifact_files,
)
from m3c.runtime.executor import Executor


@pytest.mark.parametrize("name", ["toy.m3c", "toy_dir"])
def test_round_trip_runs_the_same(tmp_path: Path, program, name: str, rng: torch.Generator) -> None:
    path = save_artifact(program, None, tmp_path / name, created_from={"how": "test"})
    assert path.is_file() == name.endswith(".m3c")
    loaded = load_artifact(path)
    assert loaded.target == "cpu" and loaded.manifest["created_from"] == {"how": "test"}
    assert set(loaded.program.weights) == set(program.weights)
    for k, t in program.weights.items():
        got = loaded.program.weights[k]
        assert got.dtype == t.dtype and torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    x = torch.randn(7, 32, generator=rng)
    assert torch.equal(Executor(loaded).run({"x": x})[0], Executor(program).run({"x": x})[0])


def test_same_inputs_give_byte_identical_artifacts(tmp_path: Path, make_program) -> None:
    a = save_artifact(make_program(seed=3), None, tmp_path / "a.m3c")
    b = save_artifact(make_program(seed=3), None, tmp_path / "b.m3c")
    assert a.read_bytes() == b.read_bytes()
    d1 = save_artifact(make_program(seed=3), None, tmp_path / "d1")
    d2 = save_artifact(make_program(seed=3), None, tmp_path / "d2")
    assert sorted(p.name for p in d1.iterdir()) == sorted(p.name for p in d2.iterdir())
    for p in d1.iterdir():
        assert p.read_bytes() == (d2 / p.name).read_bytes(), p.name
    other = save_artifact(make_program(seed=4), None, tmp_path / "c.m3c")
    assert other.read_bytes() != a.read_bytes()


def test_no_timestamps_and_sorted_zip_entries(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "t.m3c")
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    assert [i.filename for i in infos] == sorted(i.filename for i in infos)
    assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}


def test_no_pickle_anywhere(tmp_path: Path, program) -> None:
    """Only JSON, IR text and safetensors: no pickle protocol header or torch.save zip inside."""
    files = artifact_files(program, None)
    assert set(files) == {MANIFEST, GRAPH, WEIGHTS}
    json.loads(files[MANIFEST])
    files[GRAPH].decode()
    header_len = int.from_bytes(files[WEIGHTS][:8], "little")
    json.loads(files[WEIGHTS][8:8 + header_len])  # safetensors: a JSON header, then raw bytes
    blob = save_artifact(program, None, tmp_path / "p.m3c").read_bytes()
    for marker in (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"data.pkl", b"torch._utils"):
        assert marker not in blob.replace(files[WEIGHTS], b"")


def test_kernels_are_stored_and_hashed(tmp_path: Path, make_program) -> None:
    prog = make_program(target="hopper")
    path = save_artifact(prog, None, tmp_path / "h.m3c")
    manifest = verify_artifact(path)
    assert manifest["files"]["kernels/toy.cubin"]["sha256"] == sha256_bytes(b"\x7fELF fake")
    loaded = load_artifact(path, check_device=False)
    assert loaded.program.kernels == {"toy.cubin": b"\x7fELF fake"}


# ---- refusals ----------------------------------------------------------------------------------
def _rewrite(path: Path, name: str, edit) -> None:
    """Apply `edit(bytes) -> bytes` to one entry of a directory artifact."""
    f = path / name
    f.write_bytes(edit(f.read_bytes()))


def _refused(path: Path, *words: str, **kw) -> str:
    with pytest.raises(ArtifactError) as e:
        load_artifact(path, **kw)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    assert "compile" in msg or "upgrade" in msg or "remove" in msg  # says what to do
    return msg


def test_newer_format_version_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "v")
    _rewrite(path, MANIFEST, lambda b: b.replace(b'"format_version": 1', b'"format_version": 2'))
    _refused(path, "format version 2", "newer", "upgrade")


def test_unknown_format_version_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "v")
    _rewrite(path, MANIFEST, lambda b: b.replace(b'"format_version": 1', b'"format_version": "one"'))
    _refused(path, "unknown artifact format version")


def test_tampered_weights_byte_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "t")

    def flip_last(b: bytes) -> bytes:
        return b[:-1] + bytes([b[-1] ^ 1])

    _rewrite(path, WEIGHTS, flip_last)
    _refused(path, WEIGHTS, "sha256", "modified")


def test_tampered_zip_entry_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "t.m3c")
    blob = bytearray(path.read_bytes())
    weights = artifact_files(program, None)[WEIGHTS]
    at = bytes(blob).index(weights) + len(weights) - 1
    blob[at] ^= 1
    path.write_bytes(bytes(blob))
    _refused(path, "corrupt")


def test_truncated_file_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "t")
    _rewrite(path, WEIGHTS, lambda b: b[: len(b) // 2])
    _refused(path, WEIGHTS, "truncated")


def test_truncated_zip_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "t.m3c")
    path.write_bytes(path.read_bytes()[:-100])
    _refused(path, "corrupt or truncated")


def test_missing_file_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "m")
    (path / GRAPH).unlink()
    _refused(path, GRAPH, "missing")


def test_missing_manifest_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "m")
    (path / MANIFEST).unlink()
    _refused(path, "not an m3c artifact")


def test_unlisted_file_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "m")
    (path / "kernels").mkdir()
    (path / "kernels" / "evil.cubin").write_bytes(b"x")
    _refused(path, "unlisted", "kernels/evil.cubin")


def test_corrupt_zip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.m3c"
    path.write_bytes(b"PK\x03\x04 this is not a zip at all")
    _refused(path, "not a readable .m3c zip")


def test_bad_manifest_json_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "j")
    _rewrite(path, MANIFEST, lambda b: b[:-10])
    _refused(path, "not valid JSON")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_manifest(path)


def test_missing_path_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path / "nothing.m3c", "no such artifact")


def test_target_mismatch_is_refused(tmp_path: Path, make_program) -> None:
    """A hopper artifact on a machine without an H100/H200 is refused; inspection still works."""
    prog = make_program(target="hopper")
    path = save_artifact(prog, None, tmp_path / "h.m3c")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine runs hopper artifacts")
    _refused(path, "hopper", "sm_90a", "--target cpu")
    assert load_artifact(path, check_device=False).target == "hopper"


def test_unknown_target_in_manifest_is_refused(tmp_path: Path, program) -> None:
    path = save_artifact(program, None, tmp_path / "u")
    files = {p.name: p.read_bytes() for p in path.iterdir()}
    manifest = json.loads(files[MANIFEST])
    manifest["target"]["name"] = "pdp11"
    files[MANIFEST] = json.dumps(manifest).encode()
    write_artifact_files(files, path)
    _refused(path, "unknown target 'pdp11'", "hopper")


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path, program, make_program) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(ArtifactError, match="not an m3c artifact"):
        save_artifact(program, None, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    first = save_artifact(program, None, tmp_path / "again")
    assert save_artifact(make_program(seed=9), None, first) == first  # an artifact is replaced
