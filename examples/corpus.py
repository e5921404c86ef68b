"""A byte-level text corpus that is always on the machine, and a next-byte dataset over it.

With no file given, the corpus is built from the docstrings of Python's own standard library: a
fixed, sorted list of modules is imported, and `inspect.getdoc` of each module, its public classes,
their methods and its public functions is collected in a fixed order. Nothing is downloaded. The
collection runs in a fresh, isolated interpreter (`python -I`), so that what the calling process has
imported or patched (a launcher replacing a hook, say) cannot change it: the result depends only on
the Python installation. It is cached to a file, so later runs read the same bytes.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch.utils.data import Dataset

# Pure-Python, side-effect-free stdlib modules with plenty of prose in their docstrings. Kept sorted;
# a module that cannot be imported on this interpreter is skipped (the list is still fixed).
STDLIB_MODULES: tuple[str, ...] = tuple(
    sorted(
        [
            "abc",
            "argparse",
            "ast",
            "asyncio",
            "base64",
            "bisect",
            "bz2",
            "calendar",
            "cmd",
            "codecs",
            "collections",
            "concurrent.futures",
            "configparser",
            "contextlib",
            "copy",
            "csv",
            "dataclasses",
            "datetime",
            "decimal",
            "difflib",
            "dis",
            "doctest",
            "email",
            "email.message",
            "enum",
            "filecmp",
            "fnmatch",
            "fractions",
            "ftplib",
            "functools",
            "getopt",
            "gettext",
            "glob",
            "gzip",
            "hashlib",
            "heapq",
            "hmac",
            "html",
            "html.parser",
            "http.client",
            "http.cookiejar",
            "http.server",
            "imaplib",
            "inspect",
            "io",
            "ipaddress",
            "itertools",
            "json",
            "logging",
            "logging.handlers",
            "lzma",
            "mailbox",
            "math",
            "multiprocessing",
            "netrc",
            "numbers",
            "operator",
            "optparse",
            "os",
            "pathlib",
            "pdb",
            "pickle",
            "pickletools",
            "pkgutil",
            "platform",
            "plistlib",
            "poplib",
            "pprint",
            "pydoc",
            "queue",
            "random",
            "re",
            "sched",
            "secrets",
            "selectors",
            "shelve",
            "shlex",
            "shutil",
            "smtplib",
            "socket",
            "socketserver",
            "statistics",
            "string",
            "struct",
            "subprocess",
            "tarfile",
            "tempfile",
            "textwrap",
            "threading",
            "timeit",
            "tokenize",
            "trace",
            "traceback",
            "types",
            "typing",
            "unittest",
            "unittest.mock",
            "urllib.parse",
            "urllib.request",
            "uuid",
            "warnings",
            "wave",
            "weakref",
            "xml.dom.minidom",
            "xml.etree.ElementTree",
            "zipfile",
            "zoneinfo",
        ]
    )
)

SEPARATOR = "\n\n"


def _doc(obj: object) -> str | None:
    try:
        doc = inspect.getdoc(obj)
    except Exception:
        return None
    if not doc or len(doc) < 40:  # skip empty and one-word docstrings
        return None
    return doc


def _public_members(obj: object) -> list[tuple[str, object]]:
    """Public attributes of a module or class, sorted by name (never by definition order)."""
    out = []
    for name in sorted(vars(obj)):
        if name.startswith("_"):
            continue
        try:
            out.append((name, getattr(obj, name)))
        except Exception:
            continue
    return out


def stdlib_docstrings(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """The docstrings of `modules`, their public classes (with methods) and functions, in a fixed
    order; each is introduced by a header line naming it. A docstring seen before is not repeated."""
    seen: set[str] = set()
    parts: list[str] = []

    def add(header: str, obj: object) -> None:
        doc = _doc(obj)
        if doc is None or doc in seen:
            return
        seen.add(doc)
        parts.append(f"{header}\n{doc}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in modules:
            try:
                mod = importlib.import_module(modname)
            except Exception:
                continue
            add(f"# module {modname}", mod)
            for name, member in _public_members(mod):
                # Only what the module itself defines, not what it imported from elsewhere.
                if getattr(member, "__module__", None) not in (modname, f"_{modname}"):
                    continue
                if inspect.isclass(member):
                    add(f"class {modname}.{name}", member)
                    for mname, meth in _public_members(member):
                        if callable(meth) or isinstance(meth, property):
                            add(f"def {modname}.{name}.{mname}", meth)
                elif inspect.isfunction(member) or inspect.isbuiltin(member):
                    add(f"def {modname}.{name}", member)
    return SEPARATOR.join(parts) + "\n"


def stdlib_docstrings_fresh() -> bytes:
    """`stdlib_docstrings()` as UTF-8, computed by a new isolated interpreter (the same Python)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from corpus import stdlib_docstrings; "
        "sys.stdout.buffer.write(stdlib_docstrings().encode('utf-8'))"
    )
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, here], capture_output=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"building the stdlib corpus failed:\n{proc.stderr.decode(errors='replace')}"
        )
    return proc.stdout


def default_cache_dir() -> Path:
    return Path(os.environ.get("SHARDSPEED_DATA", Path(tempfile.gettempdir()) / "shardspeed-data"))


def build_corpus(cache_dir: str | os.PathLike | None = None, data_file: str | None = None) -> bytes:
    """The corpus as bytes: the contents of `data_file` if given, else the stdlib docstrings, built
    once and cached under `cache_dir` (one file per Python version, written atomically so that
    several processes may build it at the same time)."""
    if data_file is not None:
        data = Path(data_file).read_bytes()
        if len(data) < 2:
            raise ValueError(f"{data_file}: need at least 2 bytes of text, got {len(data)}")
        return data
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(("\n".join(STDLIB_MODULES) + sys.version).encode()).hexdigest()[:12]
    path = cache / f"stdlib-docs-py{sys.version_info[0]}{sys.version_info[1]}-{key}.txt"
    if path.exists():
        return path.read_bytes()
    data = stdlib_docstrings_fresh()
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return data


class ByteDataset(Dataset):
    """Next-byte windows: item i is (x, y) with x = data[i*stride : i*stride+block_size] and y the
    same window shifted by one byte, both int64 of length `block_size`. Deterministic; shuffling is
    the sampler's business."""

    def __init__(self, data: bytes | torch.Tensor, block_size: int, stride: int | None = None):
        if isinstance(data, (bytes, bytearray)):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.data = data.to(torch.long)
        self.block_size = int(block_size)
        self.stride = int(stride) if stride is not None else self.block_size
        if len(self.data) < self.block_size + 1:
            raise ValueError(
                f"corpus of {len(self.data)} bytes is shorter than one window of {block_size + 1}"
            )

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]
