"""Opt-in ``deepspeed`` import alias, so unmodified DeepSpeed scripts run on shardspeed.

After :func:`install`, and in this process only, ``import deepspeed`` gives the ``shardspeed`` module and
``import deepspeed.a.b`` gives ``shardspeed.a.b``: the same module objects, so ``deepspeed.comm is
shardspeed.comm``. DeepSpeed paths whose shardspeed module has another name are listed in
:data:`ALIASES`. A path with no shardspeed counterpart fails with an ImportError that names the missing
shardspeed module. Use it as ``python -m shardspeed.compat script.py args`` or ``shardspeed --compat``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

from shardspeed.launcher.entry import run_target

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
}


def shardspeed_name(name: str) -> str | None:
    """The shardspeed module that DeepSpeed module ``name`` resolves to, or None for other names."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        target = ALIASES.get(".".join(parts[:cut]))
        if target is not None:
            return ".".join([target, *parts[cut:]])
    return None


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
        # `from deepspeed.runtime import zero` looks the name up as shardspeed.runtime.zero, which does
        # not exist, so renamed children are imported now to be found as attributes instead.
        prefix = self.alias + "."
        for alias in ALIASES:
            if alias.startswith(prefix) and "." not in alias[len(prefix) :]:
                try:
                    importlib.import_module(alias)
                except ModuleNotFoundError as error:
                    if error.name != alias:
                        raise


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``deepspeed`` and ``deepspeed.*`` through :data:`ALIASES`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        real = shardspeed_name(fullname)
        if real is None:
            return None
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError as error:
            # Only a missing shardspeed package on the way to `real` means "no counterpart"; any other
            # missing module is a genuine failure inside shardspeed and must surface as it is.
            if error.name is None or not (real == error.name or real.startswith(error.name + ".")):
                raise
            found = None
        if found is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: the deepspeed alias maps it to {real!r}, "
                "which shardspeed does not provide",
                name=fullname,
            )
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname, real))


def install() -> None:
    """Make ``deepspeed`` imports in this process resolve to shardspeed; a second call does nothing."""
    if any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m shardspeed.compat script.py [args]``: run a DeepSpeed script on shardspeed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m shardspeed.compat script.py [args]", file=sys.stderr)
        return 2
    install()
    run_target(argv[0], argv[1:])
    return 0


if __name__ == "__main__":
    # Run through the importable module, not this __main__ copy, so that a later install() from the
    # script sees the same finder class and does nothing.
    from shardspeed.compat import main as _main

    sys.exit(_main())
