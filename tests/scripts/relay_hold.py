"""Rank script (no torch): a flodl-aware rank that holds its relay link until it is released.

argv: DIR. Runs dump_env.py as a child first (the environment a child of the rank inherits lands in
DIR/env-RANK.json), connects to its relay (RankHello up, RankWelcome back), sends three heartbeats
through it (each echoed), then writes DIR/connected-RANK and prints ``connected rank R pid N``, then waits for DIR/release-RANK and exits with the
code written in it (write it atomically: the file appears whole).
"""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from flodl_async.relay.ranklink import RankLink

out = Path(sys.argv[1])


def wait_for(path: Path) -> int:
    while not path.exists():
        time.sleep(0.05)
    return int(path.read_text())


async def main() -> int:
    async with asyncio.timeout(30):
        link = await RankLink.connect()
        for _ in range(3):
            await link.heartbeat()
    aside = out / f".connected-{link.rank}"
    aside.write_text(str(os.getpid()))
    aside.rename(out / f"connected-{link.rank}")
    print(f"connected rank {link.rank} pid {os.getpid()}", flush=True)
    code = await asyncio.to_thread(
        wait_for, out / f"release-{link.rank}"
    )  # the link stays open meanwhile
    await link.aclose()
    return code


subprocess.run([sys.executable, str(Path(__file__).with_name("dump_env.py")), str(out)], check=True)
sys.exit(asyncio.run(main()))
