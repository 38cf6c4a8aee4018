"""Rank script (no torch): handshake with the relay and three heartbeats through it to the controller."""

import asyncio
import os

from flodl_async.relay.ranklink import RankLink


async def main() -> None:
    async with asyncio.timeout(30):
        link = await RankLink.connect()
    rtts = [await link.heartbeat() for _ in range(3)]
    mode = oct(os.stat(link.spec.relay_socket).st_mode & 0o777)
    print(f"rank {link.rank} relay socket mode {mode}", flush=True)
    print(
        f"rank {link.rank} welcomed by run {link.spec.run_id}; heartbeat rtts ms {[round(r * 1000, 2) for r in rtts]}",
        flush=True,
    )
    await link.aclose()


asyncio.run(main())
