"""The rank's link thread (:class:`flodl_async.trainer.link.LinkThread`) against a real relay and a stand-in controller.

The controller side is the relay tests' control channel; the relay is real. The case here: the
coordinator welcomes the rank, then its data link cannot be opened. ``start()`` must raise that
failure, not hand back the welcome of a thread that has already ended.
"""

from __future__ import annotations

import asyncio

import pytest

from flodl_async.config.rankenv import RankSpec
from flodl_async.config.roles import LOCAL_RANK_VAR, RANK_VAR
from flodl_async.deadlines import Deadlines
from flodl_async.errors import ConnectionClosed
from flodl_async.trainer.link import LinkThread
from flodl_async.training.modelschema import ModelSchema
from flodl_async.training.spec import TrainerSpec
from flodl_async.wire import Credential
from flodl_async.wire import messages as m

from .coordkit import hello
from .test_relay import RUN, Bench, bench  # noqa: F401  (bench: the relay tests' fixture)
from .trainerwire import schema_wire


async def test_a_data_link_that_fails_after_the_welcome_is_raised_by_start(bench: Bench) -> None:  # noqa: F811  (the fixture)
    rank = 0
    credential = Credential.for_rank(bench.secret, run_id=RUN, round=0, rank=rank)
    spec = RankSpec(
        run_id=RUN,
        host="h",
        relay_socket=bench.relay.socket_path,
        data_socket="/nonexistent/flodl-data.sock",
        round=0,
        credential_hex=credential.key.hex(),
    )
    env = {
        RANK_VAR: spec.to_json(),
        LOCAL_RANK_VAR: "0",
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    trainer_hello = hello(rank, TrainerSpec(epochs=1, batch_size=4, dataset_len=32))
    link = LinkThread(
        hello=trainer_hello,
        schema=ModelSchema.from_wire(schema_wire()),
        heartbeat_timeout=10.0,
        deadlines=Deadlines.resolve(env=env),
        env=env,
    )

    async def welcome() -> None:
        while True:
            msg = await bench.controller.up.get()
            if isinstance(msg, m.TrainerHello):
                bench.down(m.TrainerWelcome(rank=msg.rank, world_size=1, run_id=RUN))
                return

    try:
        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            welcomer = tg.create_task(welcome(), name="test-welcomer")
            with pytest.raises(
                ConnectionClosed,
                match=r"rank 0 cannot reach the data socket /nonexistent/flodl-data.sock of the relay of h",
            ):
                await asyncio.to_thread(link.start)
            assert welcomer.done()  # the failure came after the welcome: the case under test
    finally:
        link.close(None)
