"""Floods on the one port (issue 19 §4): the proof throttle, the accept-rate breaker and the
eviction order, with real sockets on loopback, a real PortMux and the real join handshake.

Linux routes all of 127/8 on lo, so a flood binds its client sockets to 127.0.0.2 as source;
an honest client shares that address (as an agent and an attacker on one host share 127.0.0.1)
or stays on 127.0.0.1. Assertions are on counts and outcomes; the one window (the guesser's)
bounds how many answers it got, which a slower machine only lowers.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import AsyncIterator

import pytest

from flodl_async._version import __version__
from flodl_async.deadlines import Deadlines
from flodl_async.errors import AuthenticationFailed
from flodl_async.net.admission import AdmissionLimits
from flodl_async.net.arrivals import ArrivalPolicy
from flodl_async.net.framed import FramedProtocol, open_framed
from flodl_async.net.http import StatusHttpProtocol
from flodl_async.net.mux import PortMux
from flodl_async.net.proofthrottle import ThrottlePolicy
from flodl_async.net.service import FramedService
from flodl_async.status import Phase, StatusBoard, StatusSnapshot
from flodl_async.wire import CHANNEL_MAGIC, Channel, new_session_secret
from flodl_async.wire import messages as m
from flodl_async.wire.handshake import ClientHandshake, join_resolver
from flodl_async.wire.keys import Credential, CredentialKind, new_cluster_token

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="needs Linux: the flood binds 127.0.0.2 as source"
)

FLOOD = "127.0.0.2"
#: One delay, whatever the failures: the guesser's bound is simple arithmetic.
DELAY = 0.5
THROTTLE = ThrottlePolicy(first_delay=DELAY, max_delay=DELAY)


class Port:
    """A mux serving the join channel (the real resolver: a session secret and a cluster token)
    and status."""

    def __init__(self, mux: PortMux, token: bytes, secret: bytes) -> None:
        self.mux = mux
        self.token = token
        self.secret = secret

    @property
    def port(self) -> int:
        return self.mux.port

    def stats(self) -> dict[str, dict[str, int]]:
        s = self.mux.statistics()
        return {"dropped": s.dropped, "throttle": s.throttle, "breaker": s.breaker}


async def _greet(link: FramedProtocol) -> None:
    """The handler runs once the server verified the client's proof: it says so, then waits."""
    link.send(m.Heartbeat(sent_at=1.0))
    await link.recv()


@contextlib.asynccontextmanager
async def _port(
    *,
    limits: AdmissionLimits | None = None,
    arrivals: ArrivalPolicy | None = None,
) -> AsyncIterator[Port]:
    token, secret = new_cluster_token(), new_session_secret()
    board = StatusBoard()
    now = time.time()
    board.publish(
        StatusSnapshot(
            run_id="flood",
            phase=Phase.WAITING,
            started_at=now,
            updated_at=now,
            world_size=1,
            joined_ranks=0,
            min_rank_start=1,
            target_ranks=1,
        )
    )
    mux = PortMux(host="127.0.0.1", port=0, limits=limits, throttle=THROTTLE, arrivals=arrivals)
    async with asyncio.TaskGroup() as tg:
        service = FramedService(
            channel=Channel.JOIN,
            resolve=join_resolver(secret, token),
            run_id="flood",
            handler=_greet,
            task_group=tg,
        )
        mux.register(Channel.JOIN, service.protocol_factory)
        mux.register(Channel.STATUS, lambda: StatusHttpProtocol(board))
        await mux.start()
        try:
            yield Port(mux, token, secret)
        finally:
            await mux.aclose()  # the handlers' links close, and the handlers end


async def _join(port: Port, *, source: str, token: bytes | None = None) -> FramedProtocol:
    """A join link with ``token`` (default: the right one), within the client's handshake
    deadline; returns once the server has verified our proof (its greeting arrived)."""
    async with asyncio.timeout(Deadlines().handshake):
        link = await open_framed(
            "127.0.0.1",
            port.port,
            channel=Channel.JOIN,
            credential=Credential.token(token or port.token),
            source=source,
        )
        try:
            assert isinstance(await link.recv_message(), m.Heartbeat)
        except BaseException:
            link.abort()
            raise
    return link


async def _guess(port: Port, source: str = FLOOD) -> None:
    """One guess of the token: the controller's proof does not verify under it."""
    with pytest.raises(AuthenticationFailed):
        await _join(port, source=source, token=new_cluster_token())


async def _get_status(port: int, *, source: str = "127.0.0.1") -> int:
    """One GET /state.json; the HTTP status, or 0 when the connection ended without an answer."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    except OSError:
        return 0
    try:
        writer.write(b"GET /state.json HTTP/1.1\r\nHost: flood\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            answer = await reader.read()
            if answer.startswith(b"HTTP/1.1 "):
                return int(answer[9:12])
        return 0
    finally:
        writer.close()


# ----- the proof throttle ---------------------------------------------------------------------------


async def test_a_guessing_client_gets_a_few_answers_a_second_not_thousands() -> None:
    async with _port() as port:
        window = 2.0
        loop = asyncio.get_running_loop()
        end, guesses = loop.time() + window, 0
        while loop.time() < end:
            await _guess(port)
            guesses += 1
        # the first answer at once, then one per DELAY (unthrottled: hundreds in the window)
        assert 2 <= guesses <= 1 + window / DELAY + 1
        stats = port.stats()["throttle"]
        assert stats["delayed_answers"] >= guesses - 2
        assert stats["addresses_now"] == 1
        # another address's guesses are not slowed by this one's
        await _guess(port, source="127.0.0.3")
        assert port.stats()["throttle"]["delayed_answers"] == stats["delayed_answers"]


async def test_an_agent_behind_a_guessers_address_joins_within_its_handshake_deadline() -> None:
    async with _port() as port:
        first_failure = asyncio.Event()
        stop = asyncio.Event()

        async def guesser() -> int:
            n = 0
            while not stop.is_set():
                await _guess(port)
                n += 1
                first_failure.set()
            return n

        async with asyncio.TaskGroup() as tg:
            guessers = [tg.create_task(guesser(), name=f"guesser-{i}") for i in range(4)]
            await first_failure.wait()
            delayed_before = port.stats()["throttle"]["delayed_answers"]
            link = await _join(port, source=FLOOD)  # raises if not in within the deadline
            assert port.stats()["throttle"]["delayed_answers"] > delayed_before
            stop.set()
        link.abort()
        assert sum(g.result() for g in guessers) >= 1


async def test_a_successful_proof_resets_the_delay() -> None:
    async with _port() as port:
        for _ in range(3):
            await _guess(port)
        assert port.stats()["throttle"]["addresses_now"] == 1
        link = await _join(port, source=FLOOD)  # its answer was delayed; its proof verified
        link.abort()
        stats = port.stats()["throttle"]
        assert stats["addresses_now"] == 0
        await _guess(port)  # answered at once again
        assert port.stats()["throttle"]["delayed_answers"] == stats["delayed_answers"]


async def test_a_refusal_is_neither_delayed_nor_counted_as_a_failed_proof() -> None:
    async with _port() as port:
        for _ in range(3):
            await _guess(port)
        before = port.stats()["throttle"]
        # a rank credential is refused by name, at once: nothing to check a guess against
        hello = ClientHandshake(
            channel=Channel.JOIN,
            credential=Credential(kind=CredentialKind.RANK, key=port.token),
            version=__version__,
        ).hello()
        with socket.create_connection(("127.0.0.1", port.port), source_address=(FLOOD, 0)) as sock:
            sock.settimeout(Deadlines().handshake)
            loop = asyncio.get_running_loop()
            sock.setblocking(False)
            await loop.sock_sendall(sock, CHANNEL_MAGIC[Channel.JOIN] + hello)
            answer = await loop.sock_recv(sock, 4096)
        assert answer[1] == 1  # the refusal status, not an accept
        after = port.stats()["throttle"]
        # (the last guess's failure may have been counted after ``before`` was read: the guesser
        # raises as soon as it read the answer; a round trip later it has been counted)
        assert after["failed_proofs"] == 3
        assert after["delayed_answers"] == before["delayed_answers"]


# ----- the eviction order ---------------------------------------------------------------------------


async def test_a_handshake_in_progress_outlives_an_idle_flood_from_its_own_address() -> None:
    """Its hello answered, the honest client holds still while 200 idle connections arrive from
    its address (the cap is 64): the idle ones are evicted, and its proof still gets it in."""
    async with _port() as port:
        loop = asyncio.get_running_loop()
        client = ClientHandshake(
            channel=Channel.JOIN, credential=Credential.token(port.token), version=__version__
        )
        honest = socket.socket()
        honest.bind((FLOOD, 0))
        honest.setblocking(False)
        flood: list[socket.socket] = []
        try:
            await loop.sock_connect(honest, ("127.0.0.1", port.port))
            await loop.sock_sendall(honest, CHANNEL_MAGIC[Channel.JOIN] + client.hello())
            step = client.receive_data(await loop.sock_recv(honest, 4096))
            assert step.established is not None  # the server's proof verified under our token
            for _ in range(200):
                sock = socket.socket()
                sock.bind((FLOOD, 0))
                sock.setblocking(False)
                await loop.sock_connect(sock, ("127.0.0.1", port.port))
                flood.append(sock)
            assert await _get_status(port.port) == 200  # the loop has taken in the flood
            assert port.stats()["dropped"].get("evicted", 0) >= 200 - 64
            await loop.sock_sendall(honest, step.send)
            # the greeting comes only once the server verified our proof: it was not evicted
            assert await loop.sock_recv(honest, 4096) != b""
        finally:
            honest.close()
            for sock in flood:
                sock.close()


# ----- the accept-rate breaker ----------------------------------------------------------------------


async def test_the_breaker_closes_a_churning_address_while_another_is_answered() -> None:
    rate, burst, churned = 20.0, 50.0, 600
    async with _port(arrivals=ArrivalPolicy(rate=rate, burst=burst)) as port:
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def churn(n: int) -> None:
            for _ in range(n):
                with contextlib.suppress(OSError):
                    _reader, writer = await asyncio.open_connection(
                        "127.0.0.1", port.port, local_addr=(FLOOD, 0)
                    )
                    writer.close()

        async with asyncio.TaskGroup() as tg:
            for i in range(6):
                tg.create_task(churn(churned // 6), name=f"churn-{i}")
            statuses = [tg.create_task(_get_status(port.port)) for _ in range(50)]
        elapsed = loop.time() - started
        assert [s.result() for s in statuses] == [200] * 50
        stats = port.stats()
        closed = stats["breaker"]["closed"]
        assert closed == stats["dropped"]["churning"]
        assert closed >= churned - burst - rate * elapsed - 1
        # the churning address's status is best effort; its connections are refused, not stuck
        assert await _get_status(port.port, source="127.0.0.4") == 200
