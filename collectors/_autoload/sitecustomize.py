"""rtop's start-up hook in every Python process that ``rtop run`` starts.

``rtop run`` puts this file's directory first on ``PYTHONPATH`` and sets ``RTOP_AUTO=1``
in its command's environment, which every process of the command inherits (torchrun's
workers, DataLoader workers, subprocesses). Python's ``site`` then imports this file as
``sitecustomize`` when each interpreter starts. It does three cheap things:

1. With ``RTOP_AUTO=1``, it adds one finder to ``sys.meta_path`` that does nothing
   until ``torch`` is imported. Once torch has finished importing, it loads rtop's
   ``collectors`` (from the installation this file belongs to, whatever the process's
   ``sys.path``) and calls :func:`collectors.autoinstrument.install`, which patches
   torch so that training starts a probe. A process that never imports torch costs a
   dictionary lookup per import; one that imports torch and never trains (torchrun's
   launcher) costs the patching, about 30 ms, and starts nothing.
2. The same finder hands ``torch.distributed.fsdp`` to
   :func:`collectors.autoinstrument.sharding_imported` when it is imported.
3. It runs the ``sitecustomize`` that Python would have run without rtop (the next one
   on ``sys.path``), as that module.

A process that cannot be instrumented (rtop's collectors cannot be imported in it: an
older Python, no ``msgpack`` or ``psutil``, another package named ``collectors`` already
loaded; or a torch that cannot be patched) runs exactly as without rtop, after one
warning on stderr. Nothing here raises into the process, except what the chained
``sitecustomize`` raises, as it would have without rtop (``site`` reports it).

This file imports only the standard library, and only ``os`` and ``sys`` until torch
is imported; its code runs on any Python 3.7 or later, so that an older interpreter
warns instead of failing to read it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: This file's directory (the one ``rtop run`` puts on ``PYTHONPATH``).
HERE = os.path.dirname(os.path.abspath(__file__))
#: The directory that holds rtop's ``collectors`` package (this file is in
#: ``collectors/_autoload/``).
PACKAGES = os.path.dirname(os.path.dirname(HERE))
#: The oldest Python rtop's collectors run on.
MIN_PYTHON = (3, 10)

_warned = False


class NotInstrumented(Exception):
    """Why this process cannot be instrumented (the warning says it)."""


def warn(why: str) -> None:
    """One warning on stderr per process: it is not instrumented, and why. Never raises."""
    global _warned
    if _warned:
        return
    _warned = True
    try:
        sys.stderr.write(f"rtop: warning: process {os.getpid()} ({os.path.basename(sys.executable)}"
                         f" {sys.version.split()[0]}) is not instrumented: {why}; it runs "
                         f"as it would without rtop\n")
        sys.stderr.flush()
    except Exception:
        pass


class _Chained:
    """A module's own loader, with a hook run once the module has been executed."""

    def __init__(self, loader: Any, hook: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.hook = hook

    def create_module(self, spec: Any) -> ModuleType | None:
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # the module's code sees its own loader, never this wrapper
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        self.loader.exec_module(module)  # the module's own errors are the process's
        try:
            self.hook(module)
        except NotInstrumented as exc:
            warn(str(exc))
        except Exception as exc:
            warn(f"{type(exc).__name__}: {exc}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class AfterImport:
    """A ``sys.meta_path`` finder that runs a hook after a watched module's first import.

    It finds nothing itself: for a watched name it asks the other finders, and wraps the
    loader of the spec they return so that the hook runs once the module's code has run
    without error. Every other name costs one dictionary lookup.
    """

    def __init__(self, hooks: dict[str, Callable[[ModuleType], None]]) -> None:
        self.hooks = dict(hooks)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        del self.hooks[fullname]
        spec.loader = _Chained(spec.loader, hook)
        return spec


def load_collectors() -> ModuleType:
    """rtop's ``collectors`` package, from :data:`PACKAGES` (the installation this file
    belongs to), whatever the process's ``sys.path`` holds. Raises ImportError (or what
    the import raised) if it cannot be loaded; nothing of it stays half-imported."""
    if sys.version_info < MIN_PYTHON:
        raise ImportError(f"rtop's collectors need Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} "
                          f"or later")
    loaded = sys.modules.get("collectors")
    if loaded is not None:
        where = os.path.dirname(os.path.dirname(os.path.abspath(
            getattr(loaded, "__file__", None) or "?")))
        if os.path.realpath(where) != os.path.realpath(PACKAGES):
            raise ImportError(f"another package named collectors is loaded (from {where})")
        return loaded
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("collectors", [PACKAGES])
    if spec is None or spec.loader is None:
        raise ImportError(f"rtop's collectors are not in {PACKAGES}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["collectors"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == "collectors" or n.startswith("collectors.")]:
            del sys.modules[name]
        raise
    return module


def torch_imported(torch: ModuleType) -> None:
    """torch has just been imported: patch it (see ``collectors.autoinstrument``)."""
    try:
        load_collectors()
        from collectors import autoinstrument, sender  # noqa: F401 (all a probe needs)
    except Exception as exc:
        raise NotInstrumented(f"rtop's collectors cannot be imported here "
                              f"({type(exc).__name__}: {exc})") from exc
    try:
        autoinstrument.install(torch)
    except Exception as exc:
        raise NotInstrumented(f"this torch ({getattr(torch, '__version__', '?')}) cannot be "
                              f"patched ({type(exc).__name__}: {exc})") from exc


def fsdp_imported(fsdp: ModuleType) -> None:
    """``torch.distributed.fsdp`` has just been imported: patch it too, if torch is."""
    auto = sys.modules.get("collectors.autoinstrument")
    if auto is not None:
        auto.sharding_imported(fsdp)


def activate() -> None:
    """Watch for torch (``RTOP_AUTO=1`` only). Never raises."""
    try:
        if os.environ.get("RTOP_AUTO") != "1":
            return
        if "torch" in sys.modules:  # imported before site ran (a .pth file): patch now
            torch_imported(sys.modules["torch"])
            return
        sys.meta_path.insert(0, AfterImport({"torch": torch_imported,
                                             "torch.distributed.fsdp": fsdp_imported}))
    except NotInstrumented as exc:
        warn(str(exc))
    except Exception as exc:
        warn(f"{type(exc).__name__}: {exc}")


def chain() -> None:
    """Run the ``sitecustomize`` that Python would have run without rtop, if any: the
    next one on ``sys.path``. It becomes ``sys.modules["sitecustomize"]``; its errors
    reach ``site``, which reports them as it would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.normcase(os.path.realpath(HERE))
    path = [p for p in sys.path
            if os.path.normcase(os.path.realpath(p or os.curdir)) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # imported by site, not as collectors._autoload.sitecustomize
    activate()
    chain()
