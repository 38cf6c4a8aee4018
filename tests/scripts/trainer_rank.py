"""Rank script (no torch): speaks the Trainer's control protocol through its relay, as a rank's link thread would.

``trainer_rank.py <mode> <mode_rank> [heartbeat_timeout]``: rank ``mode_rank`` behaves as ``mode`` (``ok``, ``mismatch``: builds
``epochs=3``, ``freeze``: SIGSTOPs itself after its first plan, ``raise``: sends a death record at its second
plan, ``silent``: never says TrainerHello, ``slow``: takes 50 ms per window and says so; ``collective``: every rank builds a COLLECTIVE Trainer and answers
each collective Reduce with ReduceDone); every other rank is ``ok``. Each window is "trained" at once: the
rank reports its plan's quota. Rounds are not contributed on the data channel (the test's reducer seam
completes them); the rank prints what it trained and what it was told.
"""

import asyncio
import os
import signal
import sys

from flodl_async.config.rankenv import RankSpec
from flodl_async.config.roles import RANK_VAR
from flodl_async.net.framed import open_unix_framed
from flodl_async.training.modelschema import ModelSchema
from flodl_async.training.policy import Backend
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
    mode_name, mode_rank = sys.argv[1], int(sys.argv[2])
    heartbeat_timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
    rank = int(os.environ["RANK"])
    mode = mode_name if rank == mode_rank else "ok"
    spec_env = RankSpec.from_json(os.environ[RANK_VAR])
    credential = Credential.rank_from_hex(spec_env.credential_hex, round=spec_env.round, rank=rank)
    async with asyncio.timeout(30):
        link = await open_unix_framed(
            spec_env.relay_socket,
            channel=Channel.CONTROL,
            credential=credential,
            peer_label="relay",
        )
        link.send(
            m.RankHello(
                rank=rank,
                local_rank=int(os.environ["LOCAL_RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                pid=os.getpid(),
            )
        )
        welcome = await link.recv_message()
    assert isinstance(welcome, m.RankWelcome), welcome
    backend = Backend.COLLECTIVE if mode_name == "collective" else Backend.CPU
    spec = TrainerSpec(
        backend=backend,
        epochs=3 if mode == "mismatch" else 2,
        batch_size=4,
        dataset_len=64,
        elche=ElCheConfig(anchor=2),
        heartbeat_timeout=heartbeat_timeout,
    )
    async with asyncio.TaskGroup() as tg:
        beats = tg.create_task(beat(link, rank), name="heartbeats")
        if mode == "silent":
            await asyncio.sleep(3600)  # alive (heartbeats) but never starts its Trainer
        link.send(
            m.TrainerHello(
                rank=rank,
                spec=spec.to_wire(),
                digest=digest(spec, ModelSchema.from_wire(SCHEMA)),
                model=SCHEMA,
                model_bytes=16,
                device="cpu",
            )
        )
        trained: dict[int, list[int]] = {}
        plans = epochs_seen = 0
        while True:
            msg = await link.recv_message()
            if isinstance(msg, m.TrainerReject):
                print(f"rank {rank} rejected: {msg.reason}", flush=True)
                beats.cancel()
                return 1
            if isinstance(msg, m.TrainerWelcome):
                print(f"rank {rank} welcomed into a world of {msg.world_size}", flush=True)
            elif isinstance(msg, m.Plan):
                plans += 1
                if mode == "freeze":
                    print(f"rank {rank} freezing", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                if mode == "raise" and plans == 2:
                    link.send(
                        m.Exiting(
                            rank=rank,
                            reason="error",
                            error="Traceback (most recent call last):\nRuntimeError: boom in train_step",
                        )
                    )
                    await link.drain()
                    beats.cancel()
                    return 1
                if mode_name == "slow":
                    await asyncio.sleep(0.05)  # every rank: the test stops the run mid-training
                    print(f"rank {rank} window {msg.round}", flush=True)
                batches = [b for first, n in msg.ranges for b in range(first, first + n)]
                trained.setdefault(msg.epoch, []).extend(batches)
                link.send(
                    m.WindowDone(
                        rank=rank,
                        round=msg.round,
                        epoch=msg.epoch,
                        batches=msg.quota,
                        samples=4 * msg.quota,
                        compute_ms=1.0 * msg.quota,
                        data_ms=0.0,
                        loss_sum=0.5 * msg.quota,
                    )
                )
            elif (
                isinstance(msg, m.Reduce) and backend is Backend.COLLECTIVE and msg.kind != "upload"
            ):
                link.send(
                    m.ReduceDone(rank=rank, round=msg.round, mass=2.0, ms=0.5)
                )  # the all_reduce, as TR's ranks do it
                print(f"rank {rank} all_reduced round {msg.round} ({msg.kind})", flush=True)
            elif isinstance(msg, m.EpochAggregated):
                epochs_seen += 1
            elif isinstance(msg, m.DeclareDead):
                print(f"rank {rank} heard rank {msg.dead_rank} is dead: {msg.reason}", flush=True)
            elif isinstance(msg, m.Shutdown):
                for epoch in sorted(trained):
                    print(
                        f"rank {rank} epoch {epoch} batches {','.join(map(str, trained[epoch]))}",
                        flush=True,
                    )
                print(
                    f"rank {rank} shutdown: {msg.reason} ({msg.save_reason}); {epochs_seen} epochs aggregated",
                    flush=True,
                )
                link.send(m.Exiting(rank=rank, reason="done"))
                await link.drain()
                beats.cancel()
                return 0 if msg.save_reason in ("completed", "graceful_shutdown") else 1


sys.exit(asyncio.run(main()))
