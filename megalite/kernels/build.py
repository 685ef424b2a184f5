"""Build a C++ extension from ``csrc/`` on first use, once per process; ``None`` when it cannot be built.

Every fused op has a plain-torch fallback, so a missing compiler or ninja costs speed, never a crash: the caller gets
``None`` and one warning saying why. ``MEGALITE_DISABLE_EXTENSIONS=1`` skips building altogether.

Where: ``$MEGALITE_EXTENSIONS_DIR`` (default ``~/.cache/megalite/extensions``), one folder per Python and torch
version and extension name, because a module built against one torch does not import into another and a home
directory is often shared by machines that run different ones. Flags: ``-O3`` and no ``-march``, so a module built on
one machine type runs on any other of the same architecture.

Several ranks building at once are safe: ``torch.utils.cpp_extension.load`` lets the first process that creates
``<build dir>/lock`` (``O_CREAT | O_EXCL``) run ninja while the others wait for the file to go away and then import
the result; ninja rebuilds only what changed, so later runs just import. A build killed mid-way leaves the lock
behind and every later load waits on it forever: delete that file.
"""

from __future__ import annotations

import os
import sys
import threading
import types
import warnings
from pathlib import Path

import torch

DISABLE_ENV = "MEGALITE_DISABLE_EXTENSIONS"
DIR_ENV = "MEGALITE_EXTENSIONS_DIR"
CSRC_DIR = Path(__file__).parent.parent.parent / "csrc"   # the repository's, next to megalite/

# -fno-math-errno: otherwise std::sqrt must be able to set errno, which keeps gcc from vectorizing any loop calling it
# (results are unchanged). -ffp-contract=off: no fusing of a*b+c into an FMA where the target has one (an AVX-512
# target clone, aarch64), so every build of a kernel rounds alike, as the separate ops it replaces do. -fopenmp at
# compile and link time: at::parallel_for is a header template whose OpenMP pragma is instantiated in the extension;
# the libgomp.so.1 it links is the copy the torch wheel already loaded (same soname), so the extension runs on torch's
# thread pool and follows torch.set_num_threads.
_CFLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_modules: dict[str, types.ModuleType | None] = {}
_lock = threading.Lock()


def extensions_dir() -> Path:
    """The build root for this Python and torch version (``$MEGALITE_EXTENSIONS_DIR`` or the per-user cache)."""
    root = os.environ.get(DIR_ENV) or Path.home() / ".cache" / "megalite" / "extensions"
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
    return Path(root) / version


def load_extension(name: str, sources: list[str]) -> types.ModuleType | None:
    """The extension ``name`` built from ``sources`` (paths under ``csrc/``), or ``None`` if it cannot be had here.

    The first call in a process builds (or finds the build of) and imports the module; later calls return the same
    module, or the same ``None`` without warning again.
    """
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    with _lock:
        if name not in _modules:
            _modules[name] = _build(name, sources)
        return _modules[name]


def _build(name: str, sources: list[str]) -> types.ModuleType | None:
    paths = [CSRC_DIR / source for source in sources]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        return _give_up(name, f"source not found: {', '.join(missing)} (csrc/ is not installed with the package)")
    build_dir = extensions_dir() / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        from torch.utils import cpp_extension

        return cpp_extension.load(name=name, sources=[str(p) for p in paths], extra_cflags=_CFLAGS,
                                  extra_ldflags=_LDFLAGS, build_directory=str(build_dir), verbose=False)
    except Exception as error:   # ninja/compiler missing, compile error, import error: all mean "use the fallback"
        return _give_up(name, _reason(error))


def _reason(error: Exception) -> str:
    """One line from a build failure: the compiler's first error, else a missing program, else the message's start."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for clue in ("error:", "not found", "no such file", "fatal"):
        for line in lines:
            if clue in line.lower():
                return f"{type(error).__name__}: {line[:300]}"
    return f"{type(error).__name__}: {lines[0][:300] if lines else 'no message'}"


def _give_up(name: str, reason: str) -> None:
    warnings.warn(f"megalite: cannot build C++ extension '{name}', using the torch fallback: {reason}",
                  RuntimeWarning, stacklevel=4)
    return None
