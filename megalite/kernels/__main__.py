"""Build the fused CUDA extension ahead of time, into the cache that training loads from, and self-check its kernels::

    python -m megalite.kernels build   # e.g. in a container image build, or once before a launch

Building needs a CUDA build of torch and the CUDA toolkit, not a GPU; with a GPU, every kernel is then self-checked
on it (the verdict is cached per device name, so training reads it instead of checking again) and one line per op
says whether it runs fused. Exit status 1 where the extension cannot be built or a kernel fails its check; 0 on a
machine without CUDA (a CPU build of torch), where there is nothing to build: runs there use torch ops.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megalite.extensions import ExtensionUnavailable, extensions_dir
from megalite.kernels import self_check
from megalite.kernels.policy import EXTENSION_NAME, EXTENSION_SOURCES, OPS, fused_extension


def build() -> int:
    if torch.version.cuda is None:
        print(f"megalite: torch {torch.__version__} is built without CUDA: no fused kernels to build here, runs use "
              f"torch ops")
        return 0
    start = time.monotonic()
    try:
        module = fused_extension(required=True)
    except ExtensionUnavailable as error:
        print(f"megalite: {error}", file=sys.stderr)
        return 1
    print(f"megalite: {EXTENSION_NAME} ready in {time.monotonic() - start:.1f} s: {module.__file__} "
          f"(cache: {extensions_dir()})")
    if not torch.cuda.is_available():
        print("megalite: no CUDA device visible: the kernels self-check on the GPUs when training starts")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    failures = self_check.failed_ops(module, device, EXTENSION_NAME, EXTENSION_SOURCES)
    for op in OPS:
        verdict = f"FAILED ({failures[op]}): runs as torch ops" if op in failures else "passed: runs fused"
        print(f"  {op:<15} self-check on {self_check.device_name(device)} {verdict}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalite.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build"], help="build the extension and self-check its kernels")
    parser.parse_args(argv)
    return build()


if __name__ == "__main__":
    sys.exit(main())
