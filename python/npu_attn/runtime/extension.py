"""The compiled C++ extension, imported in this one place: every other module reaches the
kernels through ``from <...>runtime.extension import _C``, so a different build or a stand-in is
swapped here alone, and the architecture test can hold that rule."""

from .. import _C

__all__ = ["_C"]
