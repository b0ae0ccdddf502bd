from kuat.errors import KuatError, LoaderTimeoutError


def test_loader_timeout_error_is_caught_like_torchs():
    err = LoaderTimeoutError("waited 1 s")
    assert isinstance(err, KuatError) and isinstance(err, RuntimeError)
    assert isinstance(err, TimeoutError)
