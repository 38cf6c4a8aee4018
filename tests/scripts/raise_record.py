"""Rank script: rank 0 raises inside torch's @record, which writes the error file."""

import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if os.environ["RANK"] == "0":
        raise ValueError("deliberate failure for the verdict test")
    time.sleep(600)


main()
