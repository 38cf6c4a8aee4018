"""A port mux in a process whose soft descriptor limit is tiny: argv[1] is the loop (asyncio or uvloop), argv[2] the limit.

Prints ``port N``, serves until a line arrives on stdin, then closes the mux (flushing its summary)
and prints ``stats`` with the mux's accept errors and drops. Log lines go to stdout, one per line.
"""

import asyncio
import json
import logging
import resource
import sys

from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.mux import PortMux


async def main() -> None:
    # Caps above the limit on purpose: accept() itself must run out.
    limits = AdmissionLimits(max_unauthenticated=4096, max_unauthenticated_per_peer=4096)
    mux = PortMux(host="127.0.0.1", port=0, sniff_timeout=60, limits=limits, summary_interval=0.2)
    await mux.start()
    print(f"port {mux.port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await mux.aclose()
    stats = mux.statistics()
    print(
        "stats " + json.dumps({"accept_errors": stats.accept_errors, "dropped": stats.dropped}),
        flush=True,
    )


_soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), hard))
logging.basicConfig(level=logging.INFO, format="log %(levelname)s %(message)s", stream=sys.stdout)
if sys.argv[1] == "uvloop":
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
else:
    asyncio.run(main())
