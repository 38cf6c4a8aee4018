"""A relay forwarding a lone rank's contribution, in a process that must never import torch.

A hand-made controller data service (hello → welcome; a host frame → a Consensus of the same
bytes) and a hand-made rank (raw bytes, no torch) around a real Relay. Prints the checks as
``key=value`` lines for tests/test_averaging.py.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from flodl_async.deadlines import Deadlines
from flodl_async.net.framed import FramedProtocol, open_unix_framed
from flodl_async.net.mux import PortMux
from flodl_async.net.service import FramedService
from flodl_async.relay.control import Relay
from flodl_async.wire import Channel, Credential, new_session_secret
from flodl_async.wire import messages as m
from flodl_async.wire.frame import FrameLimits
from flodl_async.wire.handshake import session_resolver

RUN = "lone"
PAYLOAD = bytes(range(256)) * 8192  # 2 MiB: sealed in a worker thread on every leg
SPEC = m.TensorSpec(name="w", dtype="uint8", shape=(len(PAYLOAD),), offset=0, nbytes=len(PAYLOAD))


async def controller_data(link: FramedProtocol) -> None:
    hello = await link.recv_message()
    assert isinstance(hello, m.HostDataHello), hello
    assert link.codec is not None
    link.codec.limits = FrameLimits(max_payload=64 << 20)
    link.send(m.DataWelcome(max_payload=64 << 20))
    while True:
        frame = await link.recv()
        msg = frame.message
        assert isinstance(msg, m.HostContribution), msg
        print(
            f"up_prescaled={msg.prescaled} up_ranks={list(msg.ranks)} up_weight={msg.weight} up_same={bytes(frame.payload or b'') == PAYLOAD}"
        )
        await link.send_tensors(
            m.Consensus(round=msg.round, kind=msg.kind, mass=msg.weight, tensors=msg.tensors),
            [frame.payload] if frame.payload else [],
        )


async def drain(link: FramedProtocol) -> None:
    while True:
        await link.recv_message()


async def main() -> None:
    secret = new_session_secret()
    scratch = Path(tempfile.mkdtemp(prefix="fl-lone-", dir="/tmp"))
    mux = PortMux(host="127.0.0.1", port=0)
    try:
        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            for channel, handler in ((Channel.CONTROL, drain), (Channel.DATA, controller_data)):
                service = FramedService(
                    channel=channel,
                    resolve=session_resolver(secret),
                    run_id=RUN,
                    handler=handler,
                    task_group=tg,
                )
                mux.register(channel, service.protocol_factory)
            await mux.start()
            relay = Relay(
                socket_path=str(scratch / "relay.sock"),
                data_socket_path=str(scratch / "data.sock"),
                secret=secret,
                run_id=RUN,
                ranks=frozenset({0}),
                controller_host="127.0.0.1",
                controller_port=mux.port,
                task_group=tg,
                deadlines=Deadlines(),
                host="solo",
            )
            await relay.start()
            relay.open_round(0)
            credential = Credential.for_rank(secret, run_id=RUN, round=0, rank=0)
            link = await open_unix_framed(
                relay.data_socket_path,
                channel=Channel.DATA,
                credential=credential,
                peer_label="relay",
                limits=FrameLimits(max_payload=0),
                plain_payloads=True,
            )
            link.send(m.DataHello(rank=0, model_bytes=len(PAYLOAD), digest="x"))
            welcome = await link.recv_message()
            assert isinstance(welcome, m.DataWelcome), welcome
            assert link.codec is not None
            link.codec.limits = FrameLimits(max_payload=welcome.max_payload)
            await link.send_tensors(
                m.Contribution(round=1, kind="model", rank=0, weight=2.0, steps=2, tensors=(SPEC,)),
                [PAYLOAD],
            )
            frame = await link.recv()
            assert isinstance(frame.message, m.Consensus), frame.message
            print(
                f"down_same={bytes(frame.payload or b'') == PAYLOAD} down_mass={frame.message.mass}"
            )
            stats = relay.statistics().data
            print(f"forwarded_raw={stats.forwarded_raw} folded={stats.folded}")
            await link.aclose()
            await relay.aclose()
            await mux.aclose()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"torch_imported={'torch' in sys.modules}")


if __name__ == "__main__":
    asyncio.run(main())
