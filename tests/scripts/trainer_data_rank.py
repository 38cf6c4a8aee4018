"""Rank script (torch, CPU): the Trainer's control protocol plus real contributions on the data channel.

Each rank holds ``w = [rank + 1] * 4`` (float32) and "trains" each plan's quota at once; on ``Reduce`` it
contributes through the relay's DataLink (init: rank 0's state, the others empty; model/final: ``steps ** 1``),
adopts the consensus, and prints it. The controller runs the real Reducer.
"""

import asyncio
import os
import sys

import torch

from flodl_async.config.rankenv import RankSpec
from flodl_async.config.roles import RANK_VAR
from flodl_async.net.framed import open_unix_framed
from flodl_async.relay.datalink import DataLink
from flodl_async.training.modelschema import ModelSchema
from flodl_async.training.spec import ElCheConfig, TrainerSpec, digest
from flodl_async.wire import messages as m
from flodl_async.wire.channels import Channel
from flodl_async.wire.keys import Credential

SCHEMA = m.ModelSchemaWire(param_names=("w",), buffer_names=(), dtypes=("float32",), shapes=((4,),))


async def beat(link, rank: int) -> None:  # type: ignore[no-untyped-def]
    while True:
        link.send(m.Heartbeat(sent_at=0.0, rank=rank))
        await asyncio.sleep(0.2)


async def main() -> int:
    rank = int(os.environ["RANK"])
    env = RankSpec.from_json(os.environ[RANK_VAR])
    credential = Credential.rank_from_hex(env.credential_hex, round=env.round, rank=rank)
    async with asyncio.timeout(30):
        link = await open_unix_framed(
            env.relay_socket, channel=Channel.CONTROL, credential=credential, peer_label="relay"
        )
        link.send(
            m.RankHello(
                rank=rank,
                local_rank=int(os.environ["LOCAL_RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                pid=os.getpid(),
            )
        )
        assert isinstance(await link.recv_message(), m.RankWelcome)
    spec = TrainerSpec(
        epochs=1,
        batch_size=4,
        dataset_len=32,
        elche=ElCheConfig(anchor=2, adapt=False),
        heartbeat_timeout=10.0,
    )
    schema = ModelSchema.from_wire(SCHEMA)
    run_digest = digest(spec, schema)
    w = torch.full((4,), float(rank + 1))
    steps = 0
    async with asyncio.TaskGroup() as tg:
        beats = tg.create_task(beat(link, rank), name="heartbeats")
        link.send(
            m.TrainerHello(
                rank=rank,
                spec=spec.to_wire(),
                digest=run_digest,
                model=SCHEMA,
                model_bytes=16,
                device="cpu",
            )
        )
        data: DataLink | None = None
        while True:
            msg = await link.recv_message()
            if isinstance(msg, m.TrainerWelcome):
                async with asyncio.timeout(30):
                    data = await DataLink.connect(env, rank, schema, run_digest)
            elif isinstance(msg, m.Plan):
                steps += msg.quota
                link.send(
                    m.WindowDone(
                        rank=rank, round=msg.round, epoch=msg.epoch, batches=msg.quota, samples=4 * msg.quota,
                        compute_ms=1.0 * msg.quota, data_ms=0.0, loss_sum=0.5 * msg.quota,
                    )
                )  # fmt: skip
            elif isinstance(msg, m.Reduce):
                assert data is not None
                if msg.from_controller:
                    result = await data.receive(msg.round)
                elif msg.kind == "init":
                    result = await data.contribute(
                        msg.round,
                        "init",
                        {"w": w} if rank == 0 else None,
                        0,
                        1.0 if rank == 0 else 0.0,
                    )
                else:
                    result = await data.contribute(
                        msg.round, msg.kind, {"w": w}, steps, float(steps)
                    )
                    steps = 0
                if result.tensors is not None:
                    w = result.tensors["w"].clone()
                print(
                    f"rank {rank} round {msg.round} {msg.kind} mass {result.mass:g} w {w.tolist()}",
                    flush=True,
                )
                if msg.kind == "init":
                    w = torch.full(
                        (4,), float(rank + 1)
                    )  # diverge again, so the model rounds have something to average
            elif isinstance(msg, m.Shutdown):
                print(f"rank {rank} shutdown: {msg.reason} ({msg.save_reason})", flush=True)
                link.send(m.Exiting(rank=rank, reason="done"))
                await link.drain()
                if data is not None:
                    await data.aclose()
                beats.cancel()
                return 0


sys.exit(asyncio.run(main()))
