"""One registry mechanism for every pluggable component.

A `Registry` maps a name to one object (a function or a class). Every entry of one
registry shares one signature, stated in the registry's `signature` text so that an error
can say what a user-supplied entry must look like. Registering a name twice raises; looking
up an unknown name lists the names that exist. A registry of classes (schedules, transports, placement
policies, cost models) adds each under its own `name` attribute with `add_class`. Users extend a registry from config by
naming `package.module:object` or `path/to/file.py:object` (see `load_object`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of components of one kind.

    `kind` is what the entries are ("advantage estimator"), used in error messages;
    `signature` is a one-line description of the call every entry must accept.
    """

    def __init__(self, kind: str, signature: str = "") -> None:
        self.kind = kind
        self.signature = signature
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("gae")` adds the decorated object under `name`."""

        def add(obj: T) -> T:
            self.add(name, obj)
            return obj

        return add

    def add_class(self, cls: T) -> T:
        """Add a class under its own `name` attribute; usable as a decorator (`@SCHEDULES.add_class`).

        A class without a `name` is refused with a ValueError naming it."""
        name = getattr(cls, "name", "")
        if not name:
            raise ValueError(f"{getattr(cls, '__qualname__', repr(cls))} needs a `name` to be registered")
        self.add(name, cls)
        return cls

    def add(self, name: str, obj: T) -> None:
        if name in self._entries:
            raise KeyError(
                f"{self.kind} {name!r} is already registered (by {_describe(self._entries[name])}); "
                f"pick another name for {_describe(obj)}"
            )
        self._entries[name] = obj

    def get(self, name: str) -> T:
        """The entry called `name`; a `module:object` or `file.py:object` reference is loaded."""
        if name in self._entries:
            return self._entries[name]
        if ":" in name:
            return load_object(name)
        raise KeyError(
            f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._entries)) or '(none)'}"
            + ". A custom one is given as 'package.module:name' or 'path/file.py:name'"
            + (f" and must have the signature {self.signature}" if self.signature else "")
        )

    def names(self) -> list[str]:
        return sorted(self._entries)

    def values(self) -> list[T]:
        """The entries in the order they were registered."""
        return list(self._entries.values())

    def remove(self, name: str) -> T:
        """Take `name` out (a test's toy entry, a plugin unloaded); a KeyError naming it when absent."""
        if name not in self._entries:
            raise KeyError(f"{self.kind} {name!r} is not registered; registered: {', '.join(self.names())}")
        return self._entries.pop(name)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


def _describe(obj: Any) -> str:
    module = getattr(obj, "__module__", "?")
    qualname = getattr(obj, "__qualname__", repr(obj))
    return f"{module}.{qualname}"


def load_object(reference: str) -> Any:
    """Import `package.module:name` or `path/to/file.py:name` and return the object.

    Errors name the reference, what was not found, and the expected form.
    """
    target, sep, attr = reference.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"{reference!r} is not a reference to a Python object; "
            "write 'package.module:name' or 'path/to/file.py:name'"
        )
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            path = shipped_copy(path) or path  # the copy a cluster job ships
        if not path.is_file():
            raise FileNotFoundError(f"{reference!r}: file {path} does not exist")
        module_name = f"_hybridflow_user_{abs(hash(str(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"{reference!r}: cannot load {path} as a Python module")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ImportError(f"{reference!r}: cannot import module {target!r} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        public = [n for n in dir(module) if not n.startswith("_")]
        raise AttributeError(
            f"{reference!r}: {target} has no attribute {attr!r}; it defines {', '.join(public[:20])}"
        ) from None


# Code files a cluster job ships (hybridflow/controller/storage.py `stage_code_files` mirrors them under their
# absolute paths into this package, which the job's runtime environment sends to every node).
CODE_PACKAGE = "hybridflow_shipped_code"


def shipped_copy(path: Path) -> Path | None:
    """The copy of `path` that came with the job's runtime environment, if this process has one."""
    spec = importlib.util.find_spec(CODE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        candidate = Path(root) / str(Path(path).expanduser().resolve()).lstrip("/")
        if candidate.is_file():
            return candidate
    return None
