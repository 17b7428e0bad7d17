"""The balancer's compiled fast path, built beside the pure-Python package (pyproject.toml has
the rest of the metadata).

``src/corral/balancer/_speedups.pyx`` is compiled by Cython into the extension module
``corral.balancer._speedups`` (``corral.balancer.speedups`` says when it runs, and
``corral.balancer.lead`` is its pure-Python twin). The copy compiled carries the SHA-256 of the
source in ``SOURCE_SHA256``, so that a build older than the source beside it is never run.
Generated C goes under ``build/``, never into ``src/``.

Optional by design: without Cython or a C compiler, or when compiling fails, the install goes
on without it and the balancer runs the pure-Python build (same behaviour, more CPU).
``CORRAL_BALANCER_BUILD=pure`` skips the compile.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SOURCE = Path("src") / "corral" / "balancer" / "_speedups.pyx"
MODULE = "corral.balancer._speedups"
GENERATED = Path("build") / "cython"


def _warn(message: str) -> None:
    print(f"corral: {message}; the balancer will run its pure-Python fast path", file=sys.stderr)


def stamped_source() -> Path:
    """A copy of the source with the digest of what it was copied from."""
    text = (HERE / SOURCE).read_bytes()
    digest = hashlib.sha256(text).hexdigest()
    out = HERE / GENERATED / SOURCE.name
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = b'\n\nSOURCE_SHA256 = "%s"\n' % digest.encode()
    if not out.exists() or out.read_bytes() != text + stamp:
        out.write_bytes(text + stamp)
    return out.relative_to(HERE)


def extensions() -> list[Extension]:
    if os.environ.get("CORRAL_BALANCER_BUILD") == "pure":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        _warn("Cython is not installed, the compiled fast path is not built")
        return []
    try:
        ext = Extension(MODULE, [str(stamped_source())])
        return list(
            cythonize(
                [ext],
                build_dir=str(GENERATED),
                quiet=True,
                compiler_directives={"language_level": 3, "binding": True},
            )
        )
    except Exception as exc:  # a Cython error must not stop the install
        _warn(f"Cython could not compile {SOURCE} ({exc})")
        return []


class OptionalBuildExt(build_ext):
    """build_ext that lets the install go on when the C compile fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            _warn(f"the compiled fast path could not be built ({exc})")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            _warn(f"{ext.name} could not be built ({exc})")


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
