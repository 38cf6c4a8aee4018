"""Rank script (no torch): writes its environment as JSON into the directory given."""

import json
import os
import sys

with open(os.path.join(sys.argv[1], f"env-{os.environ['RANK']}.json"), "w") as out:
    json.dump(dict(os.environ), out)
