import sys

import numpy as np
import pytest

import kuat
from kuat.errors import KuatError, LoaderTimeoutError, MissingDependencyError, require


def test_loader_timeout_error_is_caught_like_torchs():
    err = LoaderTimeoutError("waited 1 s")
    assert isinstance(err, KuatError) and isinstance(err, RuntimeError)
    assert isinstance(err, TimeoutError)


# -- optional packages: one error class, naming the package and the extra that brings it ----
def _missing(monkeypatch, *modules):
    for name in modules:  # None in sys.modules: `import name` raises ModuleNotFoundError
        monkeypatch.setitem(sys.modules, name, None)


def _check(err, package, extra):
    assert isinstance(err, MissingDependencyError) and isinstance(err, ModuleNotFoundError)
    assert isinstance(err, KuatError) and err.name == package and err.extra == extra
    assert f"'{package}'" in str(err) and f"pip install 'kuat[{extra}]'" in str(err)
    assert isinstance(err.__cause__, ModuleNotFoundError)  # the original, chained


def test_require_returns_the_module_or_names_the_extra(monkeypatch):
    assert require("json", extra="x", needed_for="y") is sys.modules["json"]
    _missing(monkeypatch, "tokenizers")
    with pytest.raises(ImportError) as info:  # existing `except ImportError` still catches it
        require("tokenizers", extra="text", needed_for="the test")
    _check(info.value, "tokenizers", "text")


def test_every_optional_import_names_its_extra(monkeypatch, tmp_path):
    from kuat.text.corpus import train_bpe
    from kuat.text.tokenize import load_tokenizer

    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "tokdir").mkdir()
    cases = [
        ("tokenizers", "text", lambda: train_bpe(["a b c"], vocab_size=300)),
        ("tokenizers", "text", lambda: load_tokenizer(str(tmp_path / "tok.json"))),
        ("transformers", "frameworks", lambda: load_tokenizer(str(tmp_path / "tokdir"))),
        ("datasets", "hf", lambda: kuat.convert.from_hf(tmp_path / "hf", tmp_path / "o.kuat")),
        ("fsspec", "remote", lambda: kuat.open("s3://bucket/train.kuat")),
    ]
    for package, extra, call in cases:
        with monkeypatch.context() as m:
            _missing(m, package)
            with pytest.raises(MissingDependencyError) as info:
                call()
            _check(info.value, package, extra)


def test_ray_engine_without_ray_names_the_extra(monkeypatch, tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    from PIL import Image

    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(src / "0.jpg")
    monkeypatch.delitem(sys.modules, "ray.data", raising=False)
    _missing(monkeypatch, "ray")  # as if Ray were not installed
    with pytest.raises(MissingDependencyError) as info:
        kuat.convert.from_imagefolder(tmp_path / "src", tmp_path / "o.kuat", engine="ray")
    _check(info.value, "ray", "ray")


def test_cli_prints_a_missing_package_as_one_line(monkeypatch, tmp_path, capsys):
    from kuat.cli import main

    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "tok.json").write_text("{}")
    _missing(monkeypatch, "tokenizers")
    status = main(["convert", str(tmp_path / "docs.jsonl"), str(tmp_path / "o.kuat"),
                   "--tokenizer", str(tmp_path / "tok.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"kuat convert: error: the tokenizer file {tmp_path / 'tok.json'} needs the "
        "'tokenizers' package, which is not installed: pip install 'kuat[text]'"
    ]
