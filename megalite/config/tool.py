"""How the scripts in ``tools/`` end: bad input as one line on stderr and exit code 2, a closed stdout quietly.

A tool's ``main`` runs its work through :func:`run_tool`: a ConfigError (every megalite error about an input: a bad
option, checkpoint, data or tokenizer file) and an OSError (an input that cannot be read, an output that cannot be
written) become ``TOOL: error: ...`` and exit code 2. A stdout closed early (``tool ... | head``) ends the tool with
exit code 1 and nothing on stderr, as Python's documentation recommends (see "Note on SIGPIPE" in the ``signal``
module): the output was cut short, which a shell's ``pipefail`` should see, as it sees ``cat``'s SIGPIPE.
:func:`check_writable` refuses an output that cannot be created before the work that would fill it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from megalite.config.schema import ConfigError


def run_tool(prog: str, work: Callable[[], int]) -> int:
    """``work()``'s exit code, with its errors reported as the module docstring says."""
    try:
        code = work()
        sys.stdout.flush()   # a reader gone after the last print fails here, not at exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 1
    except ConfigError as error:
        message = str(error)
    except OSError as error:   # the file it names, and the system's reason, without a traceback
        message = f"{error.filename}: {error.strerror}" if error.filename and error.strerror else str(error)
    try:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    except BrokenPipeError:   # stderr is a closed pipe too: the exit code says it
        pass
    return 2


def _silence_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so that the interpreter's flush at exit (of what is still buffered)
    does not fail again and print "Exception ignored ... BrokenPipeError"."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # a stream without a descriptor (captured): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


def check_writable(path: str | os.PathLike, directory: bool = False) -> Path:
    """``path`` if the tool can write it: a file (or, with ``directory``, a directory) that is either there and
    writable or can be created with its missing parents. Else a ConfigError naming what is in the way (a regular
    file where a directory must be: permissions alone do not stop root)."""
    path = Path(path)
    if path.exists():
        if directory != path.is_dir():
            raise ConfigError(f"{path}: exists and is {'not ' if directory else ''}a directory")
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{path}: not writable")
        return path
    for parent in path.parents:   # the nearest one that exists must be a writable directory
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{path}: cannot be created: {parent} is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"{path}: cannot be created: {parent} is not writable")
            break
    return path
