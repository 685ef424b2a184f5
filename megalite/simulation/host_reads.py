"""Reading a simulated GPU's values on the host: counted, and answered with stand-ins.

A simulated GPU's tensors are meta tensors (megalite.simulation): they have shapes and dtypes but no values, so
``.item()``, ``.tolist()``, ``float(t)``, ``int(t)`` and ``bool(t)`` on them cannot answer. On a real GPU each of these
is a host synchronization (the CPU waits for the stream), so each is worth knowing about: inside
:func:`answering_host_reads` every such read is counted by call site and answered with a stand-in: 1.0 for
floating-point numbers (a loss or a norm, finite and safe to divide by), 0 for integers and True for truth values (a
finite loss): the values a healthy step's control flow takes. Where the control flow depends on the data (the
mixture of experts' split sizes) the simulation stands in at that one place (megalite.simulation.run).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from typing import Iterator

import torch

_SIMULATION = os.path.dirname(__file__)   # frames of the simulation itself are not where a read is asked for
_reads: Counter | None = None   # call site -> reads, while answering_host_reads is active


def simulating() -> bool:
    """Whether host reads of meta tensors are being answered (a simulated run is in progress)."""
    return _reads is not None


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}torch{os.sep}" not in frame.filename and _SIMULATION not in frame.filename:
            return f"{os.path.relpath(frame.filename)}:{frame.lineno} ({frame.name})"
    return "?"


def _stand_in(tensor: torch.Tensor):
    """One element's stand-in: True, 1.0 (a loss or a norm that divides cleanly) or 0 (a count)."""
    return True if tensor.dtype == torch.bool else 1.0 if tensor.is_floating_point() else 0


def _filled(shape, value):
    return value if not shape else [_filled(shape[1:], value) for _ in range(shape[0])]


@contextlib.contextmanager
def answering_host_reads() -> Iterator[Counter]:
    """Answer (and count, by call site) host reads of meta tensors inside the block."""
    global _reads
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__float__", "__int__")}

    def read(name, answer):
        original = originals[name]

        def method(self, *args, **kwargs):
            if not self.is_meta:
                return original(self, *args, **kwargs)
            _reads[_site()] += 1
            return answer(self)
        return method

    answers = {"item": _stand_in, "tolist": lambda t: _filled(list(t.shape), _stand_in(t)),
               "__bool__": lambda t: True, "__float__": lambda t: float(_stand_in(t)),
               "__int__": lambda t: int(_stand_in(t))}
    previous, _reads = _reads, Counter()
    for name, answer in answers.items():
        setattr(torch.Tensor, name, read(name, answer))
    try:
        yield _reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        _reads = previous
