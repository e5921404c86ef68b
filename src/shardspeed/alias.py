"""The opt-in ``deepspeed`` import alias, so unmodified DeepSpeed scripts run on shardspeed.

After :func:`install`, and in this process only, ``import deepspeed`` gives the ``shardspeed`` module and
``import deepspeed.a.b`` gives ``shardspeed.a.b``: the same module objects, so ``deepspeed.comm is
shardspeed.comm``. DeepSpeed paths whose shardspeed module has another name are listed in
:data:`ALIASES`; DeepSpeed modules no room has live in the compatibility layout
(``shardspeed.compat.deepspeed``). A path with no shardspeed counterpart fails with an ImportError
that names the missing shardspeed module.

Libraries look for DeepSpeed by its installed distribution too (``importlib.metadata``), so the
alias also answers for a ``deepspeed`` distribution of version :data:`DEEPSPEED_VERSION`, the
DeepSpeed release whose behaviour shardspeed follows; ``deepspeed.__version__`` reports it and
``shardspeed_version`` keeps shardspeed's own. Nothing named deepspeed is ever installed.

The hook knows modules by name only and imports nothing of shardspeed's until a ``deepspeed`` name
is imported, so every room may install it: the launcher's worker entry (``--compat``) does, and so
does ``shardspeed.compat``, the room of DeepSpeed's module layout, which re-exports these names.
Three ways in: ``python -m shardspeed.compat script.py args``, ``shardspeed --compat``, or, for
processes that other launchers start (``accelerate launch``, ``torchrun``, notebooks), the
environment variable ``SHARDSPEED_AS_DEEPSPEED=1``, read at interpreter start-up by the hook file
``shardspeed-deepspeed-alias.pth`` that installing shardspeed puts into site-packages.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

# The DeepSpeed release whose API, config schema and defaults shardspeed follows.
DEEPSPEED_VERSION = "0.19.8"
# Set to 1 (or true / yes / on) to install the alias in every Python process that starts.
ENVIRONMENT_SWITCH = "SHARDSPEED_AS_DEEPSPEED"

# DeepSpeed module path -> shardspeed module path; the longest matching prefix wins and the rest of
# the name is kept. Map packages only: a plain module cannot hold the submodules imported below it.
ALIASES: dict[str, str] = {
    "deepspeed": "shardspeed",
    "deepspeed.runtime.lr_schedules": "shardspeed.optim.lr_schedules",
    "deepspeed.runtime.zero": "shardspeed.zero",
    "deepspeed.runtime.pipe": "shardspeed.pipe",
    # Megatron's `from deepspeed.runtime.activation_checkpointing import checkpointing`: the
    # package stands for shardspeed, whose `checkpointing` is the module.
    "deepspeed.runtime.activation_checkpointing": "shardspeed",
    "deepspeed.runtime.activation_checkpointing.checkpointing": "shardspeed.checkpointing",
    "deepspeed.utils.groups": "shardspeed.comm.groups",
    "deepspeed.utils.tensor_fragment": "shardspeed.zero.tensor_fragment",
}


# DeepSpeed modules that shardspeed has no room for (`deepspeed.runtime.config`,
# `deepspeed.ops.op_builder`, ...) live under this package at DeepSpeed's own path: thin adapters
# over the rooms, so that `deepspeed.a.b` is `LAYOUT.a.b` when `shardspeed_name` finds no module.
LAYOUT = "shardspeed.compat.deepspeed"


def shardspeed_name(name: str) -> str | None:
    """The shardspeed module that DeepSpeed module ``name`` maps to by :data:`ALIASES`, or None."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        target = ALIASES.get(".".join(parts[:cut]))
        if target is not None:
            return ".".join([target, *parts[cut:]])
    return None


def layout_name(name: str) -> str:
    """Where the compatibility layout keeps DeepSpeed module ``name`` (``deepspeed.x`` ...)."""
    return LAYOUT + name[len("deepspeed") :]


def _find(name: str) -> importlib.machinery.ModuleSpec | None:
    """``importlib.util.find_spec``, with a missing package on the way to ``name`` meaning None.

    Any other missing module is a genuine failure inside shardspeed and surfaces as it is.
    """
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError as error:
        if error.name is None or not (name == error.name or name.startswith(error.name + ".")):
            raise
        return None


def resolve(name: str) -> str | None:
    """The module that DeepSpeed module ``name`` is under the alias: a room's, else the layout's."""
    real = shardspeed_name(name)
    if real is None:
        return None
    if _find(real) is not None:
        return real
    layout = layout_name(name)
    return layout if _find(layout) is not None else real


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system an already-imported shardspeed module instead of a new one."""

    def __init__(self, alias: str, target: str) -> None:
        self.alias = alias
        self.target = target
        self.target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set module.__spec__ to the alias spec; the module keeps its own
        # identity (reload, pickling, multiprocessing rely on it), so put the real spec back.
        module.__spec__ = self.target_spec
        if self.target.startswith(LAYOUT) or not hasattr(module, "__path__"):
            return
        # `from deepspeed.runtime import zero` looks the name up as shardspeed.runtime.zero, which does
        # not exist, so children found elsewhere (renamed, or in the layout) are imported now to be
        # found as attributes instead; names the layout's package adds are set on the room's.
        for child in self._children_elsewhere(module):
            try:
                importlib.import_module(f"{self.alias}.{child}")
            except ModuleNotFoundError as error:
                if error.name != f"{self.alias}.{child}":
                    raise
        layout = _find(layout_name(self.alias))
        if layout is not None and layout.submodule_search_locations is not None:
            extras = importlib.import_module(layout.name)
            for attribute in getattr(extras, "__all__", ()):
                if not hasattr(module, attribute):
                    setattr(module, attribute, getattr(extras, attribute))

    def _children_elsewhere(self, module: ModuleType) -> list[str]:
        prefix = self.alias + "."
        renamed = [
            alias[len(prefix) :]
            for alias in ALIASES
            if alias.startswith(prefix) and "." not in alias[len(prefix) :]
        ]
        layout = _find(layout_name(self.alias))
        if layout is None or layout.submodule_search_locations is None:
            return renamed
        own = module.__name__ + "."
        in_layout = [
            info.name
            for info in pkgutil.iter_modules(layout.submodule_search_locations)
            if info.name not in renamed and _find(own + info.name) is None
        ]
        return renamed + in_layout


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``deepspeed`` and ``deepspeed.*`` through :data:`ALIASES` and the layout."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = resolve(fullname)
        if real is None:
            return None
        if _find(real) is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: the deepspeed alias maps it to {real!r}, "
                "which shardspeed does not provide",
                name=fullname,
            )
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname, real))

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context | None = None
    ) -> Iterator[importlib.metadata.Distribution]:
        """Answer for the ``deepspeed`` distribution in ordinary look-ups (over ``sys.path``).

        Tools that scan explicit locations (pip lists what each site directory holds) pass their
        own path and see only what is installed there.
        """
        context = context or importlib.metadata.DistributionFinder.Context()
        wanted = context.name is None or _normalized(context.name) == "deepspeed"
        if wanted and context.path is sys.path:
            yield _DeepSpeedDistribution()


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


class _DeepSpeedDistribution(importlib.metadata.Distribution):
    """The metadata of the ``deepspeed`` that shardspeed stands in for (no files behind it)."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (
                "Metadata-Version: 2.1\n"
                "Name: deepspeed\n"
                f"Version: {DEEPSPEED_VERSION}\n"
                f"Summary: shardspeed {_shardspeed_version()} standing in for DeepSpeed\n"
            )
        return None

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        return Path(__file__).parent / path


def _shardspeed_version() -> str:
    import shardspeed

    return shardspeed.shardspeed_version


def is_installed() -> bool:
    """Whether ``deepspeed`` resolves to shardspeed in this process."""
    return any(isinstance(finder, _AliasFinder) for finder in sys.meta_path)


def switch_is_set(environ: dict[str, str] | None = None) -> bool:
    """Whether :data:`ENVIRONMENT_SWITCH` asks for the alias."""
    value = (os.environ if environ is None else environ).get(ENVIRONMENT_SWITCH, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def install_from_environment() -> None:
    """The start-up hook's call: install the alias when the switch is set, else do nothing.

    It runs before any user code, so a failure is reported and the interpreter goes on without
    the alias rather than refusing to start.
    """
    if not switch_is_set():
        return
    try:
        install()
    except Exception as error:
        print(
            f"shardspeed: {ENVIRONMENT_SWITCH} is set but the deepspeed alias could not be "
            f"installed: {error}",
            file=sys.stderr,
        )


def install() -> None:
    """Make ``deepspeed`` imports in this process resolve to shardspeed; a second call does nothing."""
    if is_installed():
        return
    real = sorted(
        name
        for name, module in sys.modules.items()
        if (name == "deepspeed" or name.startswith("deepspeed."))
        and not getattr(module, "__name__", "").startswith("shardspeed")
    )
    if real:
        raise RuntimeError(
            f"DeepSpeed itself is already imported in this process ({real[0]}); "
            "install the shardspeed alias before anything imports deepspeed"
        )
    # First on the path, so that an installed DeepSpeed is never found instead.
    sys.meta_path.insert(0, _AliasFinder())
    import shardspeed

    shardspeed.__version__ = DEEPSPEED_VERSION
    major, minor, patch = (int(part) for part in DEEPSPEED_VERSION.split("."))
    shardspeed.__version_major__, shardspeed.__version_minor__ = major, minor
    shardspeed.__version_patch__ = patch
    logging.getLogger("shardspeed").debug(
        "deepspeed resolves to shardspeed %s (as DeepSpeed %s)",
        shardspeed.shardspeed_version,
        DEEPSPEED_VERSION,
    )
