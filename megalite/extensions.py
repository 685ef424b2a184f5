"""Build a C++ or CUDA extension from ``csrc/`` on first use, once per process; ``None`` when it cannot be built.

Its users: the fused kernels (megalite.kernels), the CPU AdamW (megalite.optimizer.cpu_adam) and the data index
builders (megalite.data.index_builders). Each has a plain-torch or numpy fallback, so a missing compiler or ninja
costs speed, never a crash: the caller gets ``None`` and one warning saying why. ``MEGALITE_DISABLE_EXTENSIONS=1``
skips building altogether.

Where: ``$MEGALITE_EXTENSIONS_DIR`` (default ``~/.cache/megalite/extensions``), one folder per Python and torch
version and extension name, because a module built against one torch does not import into another and a home
directory is often shared by machines that run different ones. Flags: ``-O3`` and no ``-march``, so a module built on
one machine type runs on any other of the same architecture.

CUDA sources (``.cu``, plain CUDA, see ``csrc/cuda/``) are compiled by nvcc for sm_80 and sm_90 (A100, H100/H200:
``CUDA_ARCH_FLAGS``) with ``-O3`` and no fast math; they need a CUDA build of torch and the CUDA toolkit
(``CUDA_HOME`` or nvcc on the PATH, of the CUDA major version torch was built with), not a GPU, so
``python -m megalite.kernels build`` builds the fused kernels ahead of time, on a machine with or without one.

Several ranks building at once are safe: ``torch.utils.cpp_extension.load`` lets the first process that creates
``<build dir>/lock`` (``O_CREAT | O_EXCL``) run ninja while the others wait for the file to go away and then import
the result; ninja rebuilds only what changed, so later runs just import. A build killed mid-way leaves the lock
behind, on which torch would wait forever; so a lock older than ``$MEGALITE_BUILD_LOCK_TIMEOUT`` seconds (default
300, several times the longest build) is taken for such a leftover: the build fails with a message naming the file
to delete, and the caller falls back to torch ops (or, where the extension is required, stops with that message).
The fused kernels pass their own bound instead (``lock_timeout_s``: the distributed timeout, see
:func:`megalite.kernels.prepare`), so that a rank waiting on another's slow build waits as long as a collective would.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import torch

DISABLE_ENV = "MEGALITE_DISABLE_EXTENSIONS"
DIR_ENV = "MEGALITE_EXTENSIONS_DIR"
LOCK_TIMEOUT_ENV = "MEGALITE_BUILD_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 300.0
CSRC_DIR = Path(__file__).parent.parent / "csrc"   # the repository's, next to megalite/

# -fno-math-errno: otherwise std::sqrt must be able to set errno, which keeps gcc from vectorizing any loop calling it
# (results are unchanged). -ffp-contract=off: no fusing of a*b+c into an FMA where the target has one (an AVX-512
# target clone, aarch64), so every build of a kernel rounds alike, as the separate ops it replaces do. -fopenmp at
# compile and link time: at::parallel_for is a header template whose OpenMP pragma is instantiated in the extension;
# the libgomp.so.1 it links is the copy the torch wheel already loaded (same soname), so the extension runs on torch's
# thread pool and follows torch.set_num_threads.
_CFLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

# nvcc: one cubin per architecture the kernels are tuned and checked for (sm_80: A100; sm_90: H100, H200). torch adds
# its own -gencode flags only when none are given. No --use_fast_math: expf and erff stay accurate to a few ulp,
# which the fp32 checks of tools/gpu_check.py rely on.
CUDA_ARCH_FLAGS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
_CUDA_CFLAGS = ["-O3", *CUDA_ARCH_FLAGS]


class ExtensionUnavailable(RuntimeError):
    """A required extension cannot be had here; the message says why (compiler error, no CUDA, stale lock, ...)."""


_modules: dict[str, types.ModuleType | None] = {}
_failures: dict[str, str] = {}   # why the extension of that name could not be built
_lock = threading.Lock()


def extensions_dir() -> Path:
    """The build root for this Python and torch version (``$MEGALITE_EXTENSIONS_DIR`` or the per-user cache)."""
    root = os.environ.get(DIR_ENV) or Path.home() / ".cache" / "megalite" / "extensions"
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
    return Path(root) / version


def load_extension(name: str, sources: list[str], *, required: bool = False,
                   lock_timeout_s: float | None = None) -> types.ModuleType | None:
    """The extension ``name`` built from ``sources`` (paths under ``csrc/``; any ``.cu`` makes it a CUDA extension),
    or ``None`` if it cannot be had here; with ``required``, raise :class:`ExtensionUnavailable` instead.
    ``lock_timeout_s``: how old another process's build lock may get before it counts as stale (default
    ``$MEGALITE_BUILD_LOCK_TIMEOUT`` or 300 s).

    The first call in a process builds (or finds the build of) and imports the module; later calls return the same
    module, or the same ``None`` without warning again.
    """
    if os.environ.get(DISABLE_ENV) == "1":
        if required:
            raise ExtensionUnavailable(f"extension '{name}': {DISABLE_ENV}=1 turns building extensions off")
        return None
    with _lock:
        if name not in _modules:
            _modules[name] = _build(name, sources, warn=not required, lock_timeout_s=lock_timeout_s)
        module = _modules[name]
    if module is None and required:
        raise ExtensionUnavailable(f"cannot build extension '{name}': {_failures.get(name, 'see above')}")
    return module


def _build(name: str, sources: list[str], warn: bool, lock_timeout_s: float | None) -> types.ModuleType | None:
    paths = [CSRC_DIR / source for source in sources]
    missing = [str(p) for p in paths if not p.is_file()]
    cuda = any(p.suffix == ".cu" for p in paths)
    if missing:
        return _give_up(name, f"source not found: {', '.join(missing)} (csrc/ is not installed with the package)",
                        warn)
    build_dir = extensions_dir() / name
    try:
        from torch.utils import cpp_extension

        if cuda and torch.version.cuda is None:
            return _give_up(name, f"torch {torch.__version__} is built without CUDA", warn)
        if cuda and cpp_extension.CUDA_HOME is None:
            return _give_up(name, "no CUDA toolkit found (nvcc on the PATH, or CUDA_HOME)", warn)
        build_dir.mkdir(parents=True, exist_ok=True)
        _wait_for_build_lock(build_dir, lock_timeout_s)
        flags = dict(extra_cuda_cflags=_CUDA_CFLAGS) if cuda else {}
        return cpp_extension.load(name=name, sources=[str(p) for p in paths], extra_cflags=_CFLAGS,
                                  extra_ldflags=_LDFLAGS, build_directory=str(build_dir), verbose=False, **flags)
    except Exception as error:   # ninja/compiler missing, compile error, import error: all mean "use the fallback"
        return _give_up(name, _reason(error), warn)


def _wait_for_build_lock(build_dir: Path, timeout_s: float | None = None) -> None:
    """Wait while another process holds torch's build lock, and raise once the lock is older than ``timeout_s``
    (default ``$MEGALITE_BUILD_LOCK_TIMEOUT`` or 300 s): too old to be a live build."""
    lock = build_dir / "lock"
    timeout = timeout_s if timeout_s is not None else float(os.environ.get(LOCK_TIMEOUT_ENV) or DEFAULT_LOCK_TIMEOUT_S)
    bound = (f"{LOCK_TIMEOUT_ENV}={timeout:g} s sets how old a lock may get" if timeout_s is None
             else f"a lock may get {timeout:g} s old, the distributed timeout")
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > timeout:
            raise ExtensionUnavailable(
                f"stale build lock: {lock} is {age:.0f} s old, so the build that made it died; delete that file "
                f"(rm {lock}) and rerun ({bound})")
        time.sleep(min(1.0, max(timeout - age, 0.0) + 0.01))


def _reason(error: Exception) -> str:
    """One line from a build failure: the compiler's first error, else a missing program, else the message's start."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if isinstance(error, ExtensionUnavailable):
        return lines[0]
    for clue in ("error:", "not found", "no such file", "fatal"):
        for line in lines:
            if clue in line.lower():
                return f"{type(error).__name__}: {line[:300]}"
    return f"{type(error).__name__}: {lines[0][:300] if lines else 'no message'}"


def _give_up(name: str, reason: str, warn: bool = True) -> None:
    _failures[name] = reason
    if warn:
        warnings.warn(f"megalite: cannot build C++ extension '{name}', using the torch fallback: {reason}",
                      RuntimeWarning, stacklevel=4)
    return None
