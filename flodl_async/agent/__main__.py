"""``python -m flodl_async.agent``: the same as ``flodl-agent``."""

import sys

from .cli import main

sys.exit(main())
