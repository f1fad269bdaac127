"""``python -m npu_attn``: the command line of :mod:`npu_attn.tools.cli`."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
