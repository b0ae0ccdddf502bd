"""One cache root (``kuat._dirs``): ``KUAT_CACHE`` moves every cache kuat keeps; ``KUAT_CACHE_DIR``
still names the shard directory itself; then ``XDG_CACHE_HOME``, then ``~/.cache``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import kuat
from kuat._dirs import cache_root, shard_cache_dir
from kuat.demo_data import default_cache_dir as demo_root
from kuat.format.cache import ShardCache, default_cache_dir

_VARS = ("KUAT_CACHE", "KUAT_CACHE_DIR", "XDG_CACHE_HOME", "KUAT_BENCH_ENVS")

# (environment, expected root, expected shard directory); "~" is the test's HOME
CASES = [
    ({}, "~/.cache/kuat", "~/.cache/kuat/shards"),
    ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/kuat", "/xdg/kuat/shards"),
    ({"KUAT_CACHE": "/big"}, "/big", "/big/shards"),
    ({"KUAT_CACHE": "/big", "XDG_CACHE_HOME": "/xdg"}, "/big", "/big/shards"),
    ({"KUAT_CACHE_DIR": "/exact"}, "~/.cache/kuat", "/exact"),
    ({"KUAT_CACHE": "/big", "KUAT_CACHE_DIR": "/exact"}, "/big", "/exact"),
    ({"KUAT_CACHE": "/big", "KUAT_CACHE_DIR": "/exact", "XDG_CACHE_HOME": "/xdg"}, "/big", "/exact"),
    # empty means unset (as the XDG specification says); a leading ~ is the home directory
    ({"KUAT_CACHE": "", "KUAT_CACHE_DIR": "", "XDG_CACHE_HOME": ""}, "~/.cache/kuat",
     "~/.cache/kuat/shards"),
    ({"KUAT_CACHE": "~/big"}, "~/big", "~/big/shards"),
    # relative: KUAT_CACHE* against the working directory ("./" here), made absolute; a
    # relative XDG_CACHE_HOME is invalid (XDG specification) and ignored
    ({"KUAT_CACHE": "rel"}, "./rel", "./rel/shards"),
    ({"KUAT_CACHE_DIR": "rel/s"}, "~/.cache/kuat", "./rel/s"),
    ({"XDG_CACHE_HOME": "relxdg"}, "~/.cache/kuat", "~/.cache/kuat/shards"),
    ({"XDG_CACHE_HOME": "relxdg", "KUAT_CACHE": "../up"}, "./../up", "./../up/shards"),
]


@pytest.fixture
def env(monkeypatch, tmp_path):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)

    def set_env(values: dict[str, str]) -> Path:
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        return home

    return set_env


def _p(spec: str, home: Path) -> Path:
    if spec.startswith("./"):
        return Path(os.path.abspath(spec))  # relative to the (test's) working directory
    return home / spec[2:] if spec.startswith("~/") else Path(spec)


@pytest.mark.parametrize(("values", "root", "shards"), CASES)
def test_every_cache_follows_one_root(env, values, root, shards):
    home = env(values)
    root, shards = _p(root, home), _p(shards, home)
    assert cache_root() == root
    assert shard_cache_dir() == shards
    assert default_cache_dir() == shards  # kuat.open's default cache_dir
    assert ShardCache().dir == shards
    assert demo_root() == root  # the demo keeps root / "demo"

    from benchmarks import envs, runner

    assert runner.BenchConfig().cache_dir == (root / "bench").resolve()
    assert envs.envs_root() == root / "bench-envs"


def test_bench_envs_override(env, tmp_path):
    env({"KUAT_CACHE": "/big", "KUAT_BENCH_ENVS": str(tmp_path / "envs")})
    from benchmarks import envs

    assert envs.envs_root() == tmp_path / "envs"
    env({"KUAT_BENCH_ENVS": "rel-envs"})  # made absolute: peers' interpreters run elsewhere
    assert envs.envs_root() == Path(os.path.abspath("rel-envs"))


def test_bench_scripts_default_under_the_root(env, tmp_path, monkeypatch):
    """The standalone bench scripts (``python -m benchmarks.bench_hf``, ``.bench_text``) keep
    their data under the same root as ``kuat bench``."""
    env({"KUAT_CACHE": str(tmp_path / "big")})
    from benchmarks import bench_hf, bench_text

    class Prepared(Exception):
        pass

    def prepare(cache_dir, *args, **kwargs):
        raise Prepared(cache_dir)

    for mod in (bench_hf, bench_text):
        monkeypatch.setattr(mod, "prepare", prepare)
        with pytest.raises(Prepared) as got:
            mod.main([])
        assert got.value.args[0] == tmp_path / "big" / "bench"


def test_remote_shards_land_under_kuat_cache(env, tmp_path):
    env({"KUAT_CACHE": str(tmp_path / "big")})
    url = f"memory://kuat-test-dirs-{tmp_path.name}/d.kuat"
    schema = kuat.Schema({"y": kuat.format.int64()})
    with kuat.Writer(url, schema, shard_bytes=1 << 10) as w:
        w.write_batch({"y": np.arange(300)})
    ds = kuat.open(url)
    assert [int(ds[i]["y"]) for i in (0, 299)] == [0, 299]
    cached = sorted(p.name for p in (tmp_path / "big" / "shards").glob("*.arrow"))
    assert cached and not (tmp_path / "home").exists()
