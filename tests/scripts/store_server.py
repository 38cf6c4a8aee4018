"""The controller's port in a process of its own: a PortMux (uvloop) with the port store and status.

argv[1] is JSON: ``admission`` (AdmissionLimits fields), ``store`` (StoreLimits fields),
``nofile`` (a soft and hard descriptor limit to set first, optional). Prints ``port N``; then
each line on stdin is a command: ``stats`` prints ``stats {json}`` (the mux's drops and store
connections, the store's keys and bytes, this process's VmRSS and VmHWM in kB), ``quit`` closes
the port and exits. Log lines go to stdout as ``log LEVEL message``.
"""

import asyncio
import json
import logging
import os
import resource
import sys
import time

from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.loop import run
from flodl_async.net.mux import PortMux
from flodl_async.net.portstore import PortStore
from flodl_async.net.storegate import StoreGate
from flodl_async.status import Phase, StatusBoard, StatusSnapshot
from flodl_async.wire import Channel
from flodl_async.wire.storeproto import StoreLimits


def memory_kb() -> dict[str, int]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}


async def main(config: dict[str, dict[str, int]]) -> None:
    mux = PortMux(
        host="127.0.0.1",
        port=0,
        sniff_timeout=60,
        handshake_timeout=60,
        limits=AdmissionLimits(**config.get("admission", {})),
    )
    # the test process that started us is the store's client: its tree is "the run" here
    gate = StoreGate(roots=(os.getpid(), os.getppid()), uids=(os.geteuid(),))
    store = PortStore(limits=StoreLimits(**config.get("store", {})), gate=gate)
    store.admit_host("127.0.0.1")
    board = StatusBoard()
    now = time.time()
    board.publish(
        StatusSnapshot(run_id="store-limits", phase=Phase.WAITING, started_at=now, updated_at=now)
    )
    mux.register(Channel.STORE, store.protocol_factory)
    mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board, request_timeout=60))
    await mux.start()
    print(f"port {mux.port}", flush=True)
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "stats":
        stats = mux.statistics()
        report = {
            "dropped": stats.dropped,
            "store_now": stats.store_now,
            "store_connections": store.connections,
            "keys": len(store.state.data),
            "held": store.state.held,
            "owed": store.state.owed,
            "max_store": mux.limits.max_store,
            **memory_kb(),
        }
        print("stats " + json.dumps(report), flush=True)
    store.close()
    await mux.aclose()


settings = json.loads(sys.argv[1])
if "nofile" in settings:
    resource.setrlimit(resource.RLIMIT_NOFILE, (settings["nofile"], settings["nofile"]))
logging.basicConfig(level=logging.INFO, format="log %(levelname)s %(message)s", stream=sys.stdout)
run(main(settings))
