"""``python -m needle_wgpu`` is the ``needle-wgpu`` command."""

import sys

from .cli import main

sys.exit(main())
