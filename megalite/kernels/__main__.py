"""Build the fused CUDA extension ahead of time, into the cache that training loads from (no GPU needed: a CUDA
build of torch and the CUDA toolkit are)::

    python -m megalite.kernels        # e.g. in a container image build, so no training run compiles on start-up
"""

from __future__ import annotations

import sys
import time

from megalite.extensions import ExtensionUnavailable, extensions_dir
from megalite.kernels.policy import EXTENSION_NAME, fused_extension


def main() -> int:
    start = time.monotonic()
    try:
        module = fused_extension(required=True)
    except ExtensionUnavailable as error:
        print(f"megalite: {error}", file=sys.stderr)
        return 1
    print(f"megalite: {EXTENSION_NAME} ready in {time.monotonic() - start:.1f} s: {module.__file__} "
          f"(cache: {extensions_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
