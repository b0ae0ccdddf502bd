"""Route Accelerate's functions for kuat loaders whatever the import order (issue #29).

``import kuat`` calls :func:`watch`. This module imports nothing but ``sys`` (``import kuat``
stays cheap); :mod:`kuat.integrations.accelerate` is imported only once Accelerate is.
"""

from __future__ import annotations

import sys

__all__ = ["watch"]

_WATCHED = "accelerate.data_loader"


def _install() -> None:
    try:
        from kuat.integrations.accelerate import install

        install()
    except Exception as e:  # noqa: BLE001 (Accelerate must load and work whatever kuat does)
        import logging

        logging.getLogger("kuat.integrations.accelerate").warning(
            "kuat: Accelerate's prepare_data_loader/skip_first_batches not routed for kuat "
            "loaders: %r", e)


class _InstallAfterLoad:
    """A ``sys.meta_path`` finder that answers only for ``accelerate.data_loader``: it finds the
    module's spec with the other finders and calls :func:`install` once the module has run.
    Every other import costs one string comparison."""

    def find_spec(self, name, path=None, target=None):
        if name != _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_install(module):
            exec_module(module)
            if getattr(module, "__name__", None) == _WATCHED:  # not another module of its loader
                _install()

        try:
            loader.exec_module = exec_then_install  # this spec's own loader instance
        except AttributeError:  # a loader that takes no attributes: kuat.DataLoader installs
            pass
        return spec


def watch() -> None:
    """Make the integration independent of import order (called by ``import kuat``).

    Installs now when ``accelerate.data_loader`` is already loaded; else adds a
    ``sys.meta_path`` finder that installs right after it loads. Imports neither Accelerate nor
    torch. Idempotent.
    """
    if _WATCHED in sys.modules:
        _install()
        return
    if not any(isinstance(finder, _InstallAfterLoad) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterLoad())
