"""Rank script: rank 0 raises inside torch's @record, which writes the error file.

``--process-group``: every rank joins a gloo group first, so torch's excepthook prefixes each line
of the traceback on stderr with ``[rank0]:``.
"""

import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if "--process-group" in sys.argv:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    if os.environ["RANK"] == "0":
        raise ValueError("deliberate failure for the verdict test")
    time.sleep(600)


main()
