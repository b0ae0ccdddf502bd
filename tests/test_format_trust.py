"""Untrusted datasets (issue 16, ``docs/format.md`` "Trust"): a manifest can only name files
inside its own dataset, every manifest field is validated, and stated sizes drive no allocation.

The property tests write hostile manifests (paths, types, sizes, unicode) next to a real shard,
with a *sentinel* dataset outside that holds other values, and check that open/read, verify and
merge (library and CLI) end in a ``KuatError`` or a correct read: never a value of the sentinel,
never an ``open``/``link``/``copy`` of a file outside the dataset (watched with
``sys.addaudithook``), never another exception or a hang. Examples are derandomized (same on
every run) and few: about 20 s in all.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import posixpath
import shutil
import sys
import tempfile
import threading
import urllib.parse
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import kuat
from kuat import format as kf
from kuat.cli import main
from kuat.errors import FormatError, KuatError
from kuat.format.manifest import file_checksum
from kuat.format.merge import LINK_MODES

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
SCHEMA = {"x": kf.int64(), "s": kf.string()}


def _write(path: Path, values) -> None:
    with kuat.Writer(path, SCHEMA) as w:
        for v in values:
            w.write({"x": v, "s": f"s{v}"})


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _put(path: Path, manifest: dict) -> None:
    (path / "manifest.json").write_text(json.dumps(manifest))


# -- watching what is opened ---------------------------------------------------------------
_watch = threading.local()


def _audit(event: str, args: tuple) -> None:
    seen = getattr(_watch, "seen", None)
    if seen is None:
        return
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        seen.append(("open", os.fsdecode(args[0])))
    elif event in ("os.link", "shutil.copyfile", "os.rename", "os.remove"):
        seen.append((event, os.fsdecode(args[0])))


sys.addaudithook(_audit)  # cannot be removed; inert outside `watch()`


@contextmanager
def watch():
    """Collect ``(event, path)`` of every Python-level open/link/copy/rename/remove."""
    _watch.seen = []
    try:
        yield _watch.seen
    finally:
        _watch.seen = None


def _outside(seen, world: Path) -> list:
    """Events on paths under ``world/outside`` (resolved: a link is followed by the kernel)."""
    out = os.path.realpath(world / "outside")
    return [
        (e, p)
        for e, p in seen
        if os.path.realpath(p) == out or os.path.realpath(p).startswith(out + os.sep)
    ]


# -- the cases ---------------------------------------------------------------------
@pytest.fixture
def evil(tmp_path):
    """``ds`` (rows 0..4) and ``outside/secret.kuat`` (rows 100..102) beside it."""
    _write(tmp_path / "ds", range(5))
    _write(tmp_path / "outside" / "secret.kuat", range(100, 103))
    return tmp_path


def _point_at(ds: Path, file: str, secret: Path) -> None:
    m = _manifest(ds)
    real = _manifest(secret)["shards"][0]
    m["shards"].append(dict(real, file=file))
    m["num_rows"] += real["rows"]
    _put(ds, m)


@pytest.mark.parametrize(
    "file",
    [
        "../outside/secret.kuat/shard-00000.arrow",
        "{abs}",
        "http://127.0.0.1:9/elsewhere.arrow",
        "file://{abs}",
        "./../outside/secret.kuat/shard-00000.arrow",
        "sub/../../outside/secret.kuat/shard-00000.arrow",
        "..\\outside\\secret.kuat\\shard-00000.arrow",
        "%2e%2e/outside/secret.kuat/shard-00000.arrow",
        "shard-00000.arrow\x00",
    ],
)
def test_open_and_merge_refuse_a_shard_outside_the_dataset(evil, file):
    secret = evil / "outside" / "secret.kuat"
    file = file.format(abs=secret / "shard-00000.arrow")
    _point_at(evil / "ds", file, secret)
    with watch() as seen, pytest.raises(FormatError, match="shard 1: 'file'") as e:
        kuat.open(evil / "ds")
    assert e.value.path == str(evil / "ds" / "manifest.json") and not _outside(seen, evil)
    with watch() as seen, pytest.raises(FormatError, match="shard 1: 'file'"):
        kf.merge([evil / "ds"], evil / "m")
    assert not _outside(seen, evil)
    assert not (evil / "m" / "manifest.json").exists()
    assert not any(p.name.startswith("shard-") for p in (evil / "m").glob("*"))
    assert main(["verify", str(evil / "ds"), "--no-progress"]) == 1
    assert main(["merge", str(evil / "ds"), "-o", str(evil / "m2")]) == 1


def test_a_symlink_out_of_the_dataset_is_refused_one_inside_is_read(evil):
    ds, secret = evil / "ds", evil / "outside" / "secret.kuat"
    os.symlink(secret / "shard-00000.arrow", ds / "link.arrow")
    os.symlink(Path("..") / "outside", ds / "sub")  # a directory link: sub/... resolves out
    for name in ("link.arrow", "sub/secret.kuat/shard-00000.arrow"):
        m = _manifest(ds)
        _point_at(ds, name, secret)
        with watch() as seen:
            opened = kuat.open(ds)  # the name itself is allowed
            with pytest.raises(FormatError, match="symbolic link .* outside the dataset"):
                opened.read_batch([5])
            assert opened.read_batch(range(5))["x"].tolist() == list(range(5))
            report = kf.verify(ds)
            with pytest.raises(FormatError, match="outside the dataset"):
                kf.merge([ds], evil / "m")
        assert not _outside(seen, evil)
        assert [str(e) for e in report.errors if "outside the dataset" in str(e)]
        assert not (evil / "m").exists()  # refused before anything was written
        _put(ds, m)
    os.symlink("shard-00000.arrow", ds / "alias.arrow")  # inside: fine
    _point_at(ds, "alias.arrow", ds)
    assert kuat.open(ds).read_batch(range(10))["x"].tolist() == [0, 1, 2, 3, 4] * 2
    assert kf.verify(ds).ok


def test_merge_hard_links_or_copies_only_inside_files(evil, monkeypatch):
    secret = evil / "outside" / "secret.kuat"
    _write(evil / "b", range(5, 8))
    os.symlink(secret / "shard-00000.arrow", evil / "b" / "evil.arrow")
    m = _manifest(evil / "b")
    m["shards"][0]["file"] = "evil.arrow"
    _put(evil / "b", m)
    for link in LINK_MODES:
        with pytest.raises(FormatError, match="outside the dataset"):
            kf.merge([evil / "ds", evil / "b"], evil / f"m-{link}", link=link)
    m["shards"][0]["file"] = "shard-00000.arrow"
    _put(evil / "b", m)
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(OSError(18, "EXDEV")))
    merged = kf.merge([evil / "ds", evil / "b"], evil / "m")  # auto: falls back to copies
    assert [s.file for s in merged.shards] == ["shard-00000.arrow", "shard-00001.arrow"]
    assert kuat.open(evil / "m").read_batch(range(8))["x"].tolist() == list(range(8))
    assert kf.verify(evil / "m").ok


def test_writer_overwrite_deletes_nothing_outside(evil):
    secret = evil / "outside" / "secret.kuat"
    os.symlink(secret / "shard-00000.arrow", evil / "ds" / "link.arrow")
    m = _manifest(evil / "ds")
    m["shards"].append(dict(m["shards"][0], file="link.arrow"))
    _put(evil / "ds", m)
    with watch() as seen:
        kuat.Writer(evil / "ds", SCHEMA, overwrite=True).close()
    assert not _outside(seen, evil)
    assert os.path.islink(evil / "ds" / "link.arrow")  # a link out is not followed, not deleted
    assert kuat.open(secret).read_batch(range(3))["x"].tolist() == [100, 101, 102]
    assert kf.verify(secret).ok


@pytest.mark.parametrize(
    "where, value, match",
    [
        (
            ("schema", "fields", 0, "metadata"),
            {"names": 5},
            r"field 'x': 'metadata'\['names'\] must be a list of strings, got int 5",
        ),
        (
            ("schema", "fields", 0, "metadata"),
            {"names": ["a", 1]},
            r"\['names'\] must be a list of strings",
        ),
        (("metadata",), 5, "'metadata' must be an object, got int"),
        (("metadata",), {"classes": "cat"}, r"'metadata'\['classes'\] must be a list of strings"),
        (
            ("metadata",),
            {"class_to_idx": {"a": "0"}},
            r"'class_to_idx'\] must be an object of integers",
        ),
        (("metadata",), {"merged_from": [None]}, r"'merged_from'\] must be a list of strings"),
        (("metadata",), {"source": 1}, r"'source'\] must be a string"),
        (("created_by",), 7, "'created_by' must be a string, got int"),
        (("num_rows",), "5", "'num_rows' is '5'"),
        (("num_rows",), 5.0, "'num_rows' is 5.0"),
        (("shards", 0, "rows"), True, "shard 0 .*'rows' must be an integer"),
        (("shards", 0, "bytes"), 1.5, "shard 0 .*'bytes' must be an integer"),
        (
            ("shards", 0, "rows"),
            10**12,
            r"shard 0 .*'rows' is 1000000000000 but \d+ bytes cannot hold",
        ),
        (("shards", 0, "checksum"), "xxh3_64:zz", "shard 0 .*'checksum' must be"),
        (("shards", 0, "checksum"), "xxh3_64:" + "0" * 17, "shard 0 .*'checksum' must be"),
        (("shards", 0, "file"), 5, "shard 0: 'file' must be a string, got int"),
        (("shards", 0, "file"), "shard\u2024arrow", "shard 0: 'file' is"),  # one-dot leader
        (("shards", 0, "file"), "", "shard 0: 'file' is ''"),
        (("shards", 0, "file"), ".hidden", "shard 0: 'file' is '.hidden'"),
    ],
)
def test_every_manifest_field_is_validated_naming_field_and_manifest(evil, where, value, match):
    ds = evil / "ds"
    m = _manifest(ds)
    if where[:2] == ("shards", 0) and where[2] == "rows":
        m["num_rows"] = value  # only the shard's own check can refuse it
    obj = m
    for key in where[:-1]:
        obj = obj[key]
    obj[where[-1]] = value
    _put(ds, m)
    with pytest.raises(FormatError, match=match) as e:
        kuat.open(ds)
    assert e.value.path == str(ds / "manifest.json")
    assert str(ds / "manifest.json") in str(e.value)


def test_a_manifest_larger_than_the_limit_is_not_read(evil, monkeypatch):
    import kuat.format.manifest as manifest_mod

    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 64)
    with pytest.raises(FormatError, match="more than the 64 a kuat manifest may have"):
        kuat.open(evil / "ds")


def _ipc(batch: pa.RecordBatch, compression: str | None, file_format: bool = False) -> bytes:
    sink = io.BytesIO()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    new = pa.ipc.new_file if file_format else pa.ipc.new_stream
    with new(sink, batch.schema, options=opts) as w:
        w.write_batch(batch)
    return sink.getvalue()


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
@pytest.mark.parametrize("file_format", [False, True])
def test_a_compressed_shard_is_refused_before_it_is_decompressed(
    tmp_path, compression, file_format
):
    """A compressed IPC body states its own decompressed size: 16 MiB from a few hundred bytes
    here (a bomb stating terabytes is no bigger). kuat writes uncompressed shards only."""
    n = 2 << 20
    schema = kuat.Schema({"x": kf.int64()})
    batch = pa.record_batch([pa.array(np.zeros(n, np.int64))], schema=schema.to_arrow())
    data = _ipc(batch, compression, file_format)
    assert len(data) < n  # (B,) int64 zeros: 16 MiB stated, far fewer bytes stored
    _write(tmp_path / "d", [0])
    (tmp_path / "d" / "shard-00000.arrow").write_bytes(data)
    m = _manifest(tmp_path / "d")
    m["schema"] = schema.to_json()
    m["shards"] = [
        {
            "file": "shard-00000.arrow",
            "rows": n,
            "bytes": len(data),
            "checksum": file_checksum(tmp_path / "d" / "shard-00000.arrow"),
        }
    ]
    m["num_rows"] = n
    _put(tmp_path / "d", m)
    with pytest.raises(FormatError):  # the stated rows cannot fit: refused at open
        kuat.open(tmp_path / "d")
    m["shards"][0]["rows"] = m["num_rows"] = len(data) // 8  # rows that fit the file's bytes
    _put(tmp_path / "d", m)
    ds = kuat.open(tmp_path / "d")
    with pytest.raises(FormatError, match="compressed buffers") as e:
        ds.read_batch([0])
    assert e.value.path == str(tmp_path / "d" / "shard-00000.arrow")
    # the same bytes uncompressed are read (a shard in the IPC file format too)
    (tmp_path / "d" / "shard-00000.arrow").write_bytes(_ipc(batch.slice(0, 3), None, file_format))
    m["shards"][0].update(rows=3, bytes=os.path.getsize(tmp_path / "d" / "shard-00000.arrow"))
    m["num_rows"] = 3
    _put(tmp_path / "d", m)
    assert kuat.open(tmp_path / "d").read_batch([0, 2])["x"].tolist() == [0, 0]


def test_inspect_escapes_control_characters_from_the_dataset(tmp_path, capsys):
    esc = "\x1b]0;pwned\x07\x1b[2J"
    schema = kuat.Schema([kuat.Field("x" + esc, kf.int64(), {"names": ["a" + esc]})])
    with kuat.Writer(tmp_path / "d", schema, metadata={"k" + esc: "v" + esc}) as w:
        w.write({"x" + esc: 0})
    m = _manifest(tmp_path / "d")
    m["created_by"] = "kuat" + esc
    _put(tmp_path / "d", m)
    assert main(["inspect", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    # field name, its names, created_by, metadata key and value, the sample row's key
    assert out.count("\\x1b]0;pwned\\x07") == 6


class _Boom:
    """Unpickling this creates ``path``: the proof that something unpickled shard bytes."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_no_unpickling_of_arrow_extension_metadata(tmp_path):
    """``arrow.py_extension_type`` fields carried a pickle that pyarrow < 14.0.1 unpickled on
    read (CVE-2023-47248). A shard declaring one must be read as its storage type or refused,
    never unpickled."""
    import pickle

    proof = str(tmp_path / "unpickled")
    meta = {
        b"ARROW:extension:name": b"arrow.py_extension_type",
        b"ARROW:extension:metadata": pickle.dumps(_Boom(proof)),
    }
    field = pa.field("x", pa.int64(), nullable=False, metadata=meta)
    batch = pa.record_batch([pa.array([7, 8], pa.int64())], schema=pa.schema([field]))
    _write(tmp_path / "d", [0])
    m = _manifest(tmp_path / "d")
    m["schema"] = kuat.Schema({"x": kf.int64()}).to_json()
    shard = tmp_path / "d" / "shard-00000.arrow"
    shard.write_bytes(_ipc(batch, None))
    m["shards"][0].update(rows=2, bytes=shard.stat().st_size, checksum=file_checksum(shard))
    m["num_rows"] = 2
    _put(tmp_path / "d", m)
    try:
        assert kuat.open(tmp_path / "d").read_batch([0, 1])["x"].tolist() == [7, 8]
    except FormatError:
        pass
    kf.verify(tmp_path / "d")
    assert not os.path.exists(proof)


# -- the rule itself ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    ["shard-00000.arrow", "a/b/c.arrow", "A_b-9.x", "x" * 255, "d/" * 600 + "x"],
)
def test_allowed_names(name, tmp_path):
    from kuat.format.manifest import check_member_name, member_path

    ok = len(name) <= 1024
    if ok:
        assert check_member_name(name) == name
        assert member_path(tmp_path, name) == os.path.join(tmp_path, name)
    else:
        with pytest.raises(FormatError):
            check_member_name(name)


@given(
    name=st.text(max_size=40) | st.sampled_from(["..", ".", "/", "a/../b", "a//b", "C:x", "a:b"])
)
@settings(max_examples=300, **SETTINGS)
def test_an_accepted_name_stays_below_a_local_root_and_a_url_prefix(name):
    from kuat.format.manifest import check_member_name, member_path

    root = "/data/train.kuat"
    prefix = "http://127.0.0.1:9/bucket/train.kuat"
    try:
        check_member_name(name)
    except FormatError:
        for r in (root, prefix, "s3://bucket/train.kuat", "file:///data/train.kuat"):
            with pytest.raises(FormatError):
                member_path(r, name)
        return
    assert posixpath.normpath(name) == name and not posixpath.isabs(name) and "\\" not in name
    assert os.path.commonpath([root, posixpath.join(root, name)]) == root
    url = urllib.parse.urlsplit(member_path(prefix, name))
    want = urllib.parse.urlsplit(prefix)
    assert (url.scheme, url.netloc, url.query, url.fragment) == (want.scheme, want.netloc, "", "")
    assert urllib.parse.unquote(url.path).startswith(want.path + "/")
    assert ".." not in urllib.parse.unquote(url.path).split("/")
    assert member_path("s3://bucket/train.kuat/", name) == f"s3://bucket/train.kuat/{name}"


# -- property tests over hostile manifests --------------------------------------------------
_WORLD = None
_MANIFESTS: dict[str, dict] = {}


def _world() -> Path:
    """Built once: ``ds`` (x = 0..4, one shard), ``outside/`` a sentinel (x = 1000..1004) and
    a FIFO; in ``ds``, links out (file, absolute, directory), a link in, and a FIFO."""
    global _WORLD
    if _WORLD is None:
        world = Path(tempfile.mkdtemp(prefix="kuat-trust-"))
        atexit.register(shutil.rmtree, world, True)
        _write(world / "ds", range(5))
        _write(world / "outside" / "sentinel.kuat", range(1000, 1005))
        sentinel = world / "outside" / "sentinel.kuat" / "shard-00000.arrow"
        os.symlink(
            Path("..") / "outside" / "sentinel.kuat" / "shard-00000.arrow",
            world / "ds" / "out.arrow",
        )
        os.symlink(sentinel, world / "ds" / "abs.arrow")
        os.symlink(world / "outside", world / "ds" / "sub")
        os.symlink("shard-00000.arrow", world / "ds" / "in.arrow")
        os.mkfifo(world / "ds" / "fifo.arrow")
        os.mkfifo(world / "outside" / "fifo.arrow")
        _MANIFESTS["ds"] = _manifest(world / "ds")
        _MANIFESTS["sentinel"] = _manifest(world / "outside" / "sentinel.kuat")
        _WORLD = world
    return _WORLD


def _good() -> dict:
    _world()
    return json.loads(json.dumps(_MANIFESTS["ds"]))  # a deep copy


def _sentinel_entry() -> dict:
    _world()
    return dict(_MANIFESTS["sentinel"]["shards"][0])


_PARTS = [
    "..",
    ".",
    "",
    "outside",
    "sentinel.kuat",
    "shard-00000.arrow",
    "out.arrow",
    "abs.arrow",
    "in.arrow",
    "sub",
    "fifo.arrow",
    "%2e%2e",
    "..\\..",
    "\x00",
    "\uff0e\uff0e",
    "\u2025",
    "~",
]


def _hostile_names():
    world = _world()
    sentinel = str(world / "outside" / "sentinel.kuat" / "shard-00000.arrow")
    crafted = st.sampled_from(
        [
            sentinel,
            "file://" + sentinel,
            "http://127.0.0.1:9/elsewhere.arrow",
            "http://localhost:9/../x.arrow",
            "//127.0.0.1/x.arrow",
            "../outside/sentinel.kuat/shard-00000.arrow",
            "sub/sentinel.kuat/shard-00000.arrow",
            "sub/fifo.arrow",
            "out.arrow",
            "abs.arrow",
            "in.arrow",
            "fifo.arrow",
            "shard-00000.arrow",
        ]
    )
    parts = st.lists(st.sampled_from(_PARTS), min_size=1, max_size=5).map("/".join)
    return st.one_of(crafted, crafted, crafted, crafted, parts, st.text(min_size=1, max_size=20))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=5,
)


@st.composite
def hostile_manifests(draw) -> dict:
    m = _good()
    true = m["shards"][0]
    n = draw(st.integers(1, 3))
    shards = []
    for _ in range(n):
        file = draw(_hostile_names())
        # an entry naming the sentinel mostly carries its sizes, so only the path can refuse it
        out = "sentinel" in file or file in ("out.arrow", "abs.arrow")
        base = dict(_sentinel_entry() if out and draw(st.integers(0, 3)) else true)
        base["file"] = file
        for key in ("rows", "bytes", "checksum"):
            if draw(st.integers(0, 5)) == 3:  # ~1/6 (not 0: hypothesis favours it)
                base[key] = draw(_json | st.integers(-1, 2**63))
        shards.append(base)
    m["shards"] = shards
    m["num_rows"] = sum(s["rows"] for s in shards if isinstance(s.get("rows"), int))
    if draw(st.integers(0, 3)) == 2:
        m["schema"]["fields"][0]["metadata"] = draw(
            st.dictionaries(st.sampled_from(["names", "u"]), _json, max_size=2)
        )
    if draw(st.integers(0, 3)) == 2:
        m["metadata"] = draw(
            st.dictionaries(
                st.sampled_from(["classes", "class_to_idx", "merged_from", "source", "u\u00e9"]),
                _json,
                max_size=3,
            )
        )
    if draw(st.integers(0, 7)) == 5:
        key = draw(
            st.sampled_from(
                ["format", "version", "created_by", "num_rows", "schema", "shards", "metadata"]
            )
        )
        m[key] = draw(_json)
    return m


def _check_no_escape(seen) -> None:
    assert not _outside(seen, _world()), _outside(seen, _world())


@given(m=hostile_manifests())
@settings(max_examples=150, **SETTINGS)
def test_open_and_read_a_hostile_manifest(m):
    ds_dir = _world() / "ds"
    _put(ds_dir, m)
    with watch() as seen:
        try:
            ds = kuat.open(ds_dir)
        except KuatError:
            ds = None
        xs = []
        for i in range(min(len(ds), 30) if ds is not None else 0):
            try:  # every row, also after a bad shard
                xs.append(ds.raw(i)["x"])
            except KuatError:
                pass
        rc = main(["inspect", str(ds_dir), "-n", "3"])
    _check_no_escape(seen)
    assert rc == (0 if ds is not None and len(xs) >= min(len(ds), 3) else rc) and rc in (0, 1)
    assert set(xs) <= set(range(5)), xs  # a correct read: the dataset's rows, not the sentinel's


@given(m=hostile_manifests())
@settings(max_examples=60, **SETTINGS)
def test_verify_a_hostile_manifest(m):
    ds_dir = _world() / "ds"
    _put(ds_dir, m)
    with watch() as seen:
        try:
            report = kf.verify(ds_dir)
        except KuatError:
            report = None
        rc = main(["verify", str(ds_dir), "--no-progress"])
    _check_no_escape(seen)
    assert rc in (0, 1)
    if report is not None and report.ok:
        assert rc == 0
        assert all(s["file"] in ("shard-00000.arrow", "in.arrow") for s in m["shards"])


@given(m=hostile_manifests(), link=st.sampled_from(LINK_MODES), cli=st.booleans())
@settings(max_examples=60, **SETTINGS)
def test_merge_a_hostile_manifest(m, link, cli):
    world = _world()
    _put(world / "ds", m)
    out = Path(tempfile.mkdtemp(prefix="merged-", dir=world))
    try:
        with watch() as seen:
            if cli:
                rc = main(
                    ["merge", str(world / "ds"), "-o", str(out), "--link", link, "--overwrite"]
                )
            else:
                try:
                    kf.merge([world / "ds"], out, link=link, overwrite=True)
                    rc = 0
                except KuatError:
                    rc = 1
        _check_no_escape(seen)
        assert rc in (0, 1)
        sentinel = os.stat(world / "outside" / "sentinel.kuat" / "shard-00000.arrow")
        for p in out.iterdir():
            st_ = os.lstat(p)
            assert not os.path.islink(p) and (st_.st_dev, st_.st_ino) != (
                sentinel.st_dev,
                sentinel.st_ino,
            )
        if rc == 0:
            got = kuat.open(out)
            assert set(got.read_batch(range(len(got)))["x"].tolist()) <= set(range(5))
            assert kf.verify(out).ok == kf.verify(world / "ds").ok  # same bytes, same records
    finally:
        shutil.rmtree(out)
