"""Attacks 1–3 of the wire-v2 issue, reproduced against a real flodl-launch and a real flodl-agent, and shown to fail.

Found against wire v1 (per-run keys, sequence numbers from 0 on every connection, ranks
holding the raw secret):

1. bytes a stand-alone agent sent in one run were valid in the next run with the same
   ``--secret-file``: a replayed join admitted a phantom host, and a replayed ``RankExited``
   made the launcher exit 0 for a rank that never ran;
2. a recorded ``RankHello`` + ``Heartbeat`` replayed on a new control connection got
   ``RankWelcome`` and an echo, and a forged ``RankHello`` changed a rank's pid;
3. every rank (and child, and tool logging the environment) held the session secret.

A recording TCP proxy (:mod:`tests.replaykit`) sits between the walk-in agent and the
controller, so the agent's join link and its relay's upstream control link are recorded.
(Its store host's rendezvous link never is: in this version the store host is always the
controller's own local worker, which dials the port directly; whatever the proxy records,
every test replays.)
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from flodl_async._version import __version__
from flodl_async.config.rankenv import RankSpec
from flodl_async.config.roles import RANK_VAR
from flodl_async.deadlines import Deadlines
from flodl_async.errors import (
    AuthenticationFailed,
    ConnectionClosed,
    HandshakeFailed,
    HandshakeRefused,
    WireError,
)
from flodl_async.net.framed import FramedProtocol, open_framed, open_unix_framed
from flodl_async.wire import Channel, Credential, CredentialKind
from flodl_async.wire import messages as m
from flodl_async.wire.keys import SECRET_BYTES, secret_from_hex
from flodl_async.wire.schema import Message

from .launchkit import (
    PY,
    Finished,
    assert_nothing_left,
    free_port,
    launch_cmd,
    new_run_id,
    script,
    wait_status,
)
from .replaykit import (
    Answer,
    Background,
    Recorded,
    RecordingProxy,
    client_hello_end,
    connect,
    decode_recording,
    insist_on_port,
    insist_on_unix,
    message_length,
    parse_server_hello,
    read_server_hello,
    read_until_closed,
    replay_burst,
    replay_paced,
    send_all,
)

pytestmark = pytest.mark.e2e

WALK_IN = "walk-in"
#: What the controller logs, once per connection, when a handshake fails: the two ways a replay can fail.
BAD_PROOF = "the peer's handshake proof did not verify"

Status = dict[str, Any]


@pytest.fixture(scope="module")
def xdg() -> Iterator[Path]:
    """A private, short XDG_RUNTIME_DIR for the runs (pytest's tmp_path may be too deep for the relay's socket path)."""
    path = Path(tempfile.mkdtemp(prefix="fl-xdg-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Run:
    """One flodl-launch run: a local worker with rank 0, waiting for a walk-in agent's ranks.

    Every rank runs ``relay_hold.py``: it dumps a child's environment, connects to its relay
    (RankHello, three Heartbeats up the control channel) and holds until :meth:`release`.
    Leaving the ``with`` block kills what still runs and checks nothing of the run survives.
    """

    def __init__(
        self, base: Path, *, name: str, secret_file: Path, port: int, walk_in_ranks: int, xdg: Path
    ) -> None:
        self.dir = base / name
        self.ranks_dir = self.dir / "ranks"
        self.ranks_dir.mkdir(parents=True)
        self.run_id = new_run_id()
        self.port = port
        self.secret_file = secret_file
        self.walk_in_ranks = walk_in_ranks
        self.world_size = 1 + walk_in_ranks
        self.env = {"XDG_RUNTIME_DIR": str(xdg)}
        cluster = self.dir / "cluster.yml"
        size = self.world_size
        cluster.write_text(
            f"controller:\n  port: {port}\n  join: {{min_rank_start: {size}, target_ranks: {size}, join_timeout: 60}}\n"
            "workers:\n  - host: localhost\n    devices: cpu:1\n"
        )
        command = launch_cmd(
            str(cluster),
            "--secret-file",
            str(secret_file),
            "--stop-grace",
            "3",
            "--",
            PY,
            script("relay_hold.py"),
            str(self.ranks_dir),
            run_id=self.run_id,
        )
        self.launcher = Background(command, out_dir=self.dir, name="launcher", env=self.env)
        self.agent: Background | None = None

    def __enter__(self) -> Run:
        try:
            wait_status(
                self.port, lambda d: d["run_id"] == self.run_id and d["joined_ranks"] == 1
            )  # the window is open, the local host is in
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def secret(self) -> bytes:
        return secret_from_hex(self.secret_file.read_text())

    def start_agent(self, controller_port: int) -> None:
        """The stand-alone flodl-agent for host ``walk-in``, dialling ``controller_port`` (the proxy's or the controller's)."""
        self.agent = Background(
            [PY, "-m", "flodl_async.agent", "--controller", f"127.0.0.1:{controller_port}", "--secret-file", str(self.secret_file),
             "--host", WALK_IN, "--devices", f"cpu:{self.walk_in_ranks}", "--stop-grace", "3"],
            out_dir=self.dir, name="agent", env=self.env,
        )  # fmt: skip

    def status(
        self, predicate: Callable[[Status], bool] = lambda _d: True, *, timeout: float = 30
    ) -> Status:
        """The first /state.json document for which ``predicate`` holds (its ``connections`` may lag by 0.5 s)."""
        return wait_status(self.port, predicate, timeout=timeout)

    def wait_connected(self) -> Status:
        """Until every rank's RankHello and heartbeats went through its relay: its marker file, and its pid in the status."""
        markers = [self.ranks_dir / f"connected-{rank}" for rank in range(self.world_size)]
        return self.status(
            lambda d: (
                d["phase"] == "training"
                and all(marker.exists() for marker in markers)
                and {r["rank"]: r["pid"] for r in d["ranks"]}
                == {rank: int(marker.read_text()) for rank, marker in enumerate(markers)}
                and all(r["state"] == "connected" for r in d["ranks"])
            )
        )

    def release(self, rank: int, exit_code: int) -> None:
        """Let ``rank`` exit with ``exit_code`` (the file appears whole: written aside, then renamed)."""
        aside = self.ranks_dir / f".release-{rank}"
        aside.write_text(str(exit_code))
        aside.rename(self.ranks_dir / f"release-{rank}")

    def finish(self) -> tuple[Finished, Finished]:
        """Wait for the launcher and the agent to exit."""
        assert self.agent is not None
        return self.launcher.finish(60), self.agent.finish(60)

    def close(self) -> None:
        self.launcher.kill()
        if self.agent is not None:
            self.agent.kill()
        assert_nothing_left(self.run_id)


def _ranks(doc: Status) -> dict[int, tuple[str, str, int | None]]:
    """rank → (host, state, pid), from /state.json."""
    return {r["rank"]: (r["host"], r["state"], r["pid"]) for r in doc["ranks"]}


def _members(doc: Status) -> dict[str, list[int]]:
    return {mb["host"]: mb["ranks"] for mb in doc["members"]}


@dataclass(frozen=True, slots=True, kw_only=True)
class Replayed:
    recording: Recorded
    how: str
    answer: Answer

    def __str__(self) -> str:
        channel = self.recording.channel.value if self.recording.channel is not None else "?"
        return f"{self.how} replay of recorded {channel} connection #{self.recording.index}"


def _replay_all(
    port: int, recordings: list[Recorded], *, after_each: Callable[[Replayed], None]
) -> list[Replayed]:
    """Every recorded connection, in the original order, once all at once and once paced; ``after_each`` checks the run."""
    done = []
    for recording in recordings:
        for how, replay in (("burst", replay_burst), ("paced", replay_paced)):
            replayed = Replayed(recording=recording, how=how, answer=replay(port, recording.client))
            after_each(replayed)
            done.append(replayed)
    return done


def _assert_refused_without_a_frame(replayed: list[Replayed]) -> None:
    """At most the server's (fresh) hello came back, then the close; the paced ones were answered by an accept hello."""
    for r in replayed:
        assert r.answer.at_most_a_hello, (
            f"{r}: {len(r.answer.after)} bytes came back after the server hello"
        )
        if r.how == "paced":
            assert r.answer.hello, f"{r}: the clear hello was not answered"
            fresh = parse_server_hello(r.answer.hello)
            recorded_len = message_length(r.recording.server)
            assert recorded_len is not None
            assert fresh.accepted
            assert (
                fresh.nonce != parse_server_hello(r.recording.server[:recorded_len]).nonce
            )  # a new nonce: new keys


def _refused(doc: Status, *reasons: str) -> int:
    """Connections the controller counted as refused for ``reasons`` (the log only summarises them)."""
    dropped = doc["connections"]["dropped"]
    return sum(dropped.get(reason, 0) for reason in reasons)


#: How the controller counts a failed handshake: a bad proof, or a peer that broke the handshake's rules.
HANDSHAKE_FAILURES = ("auth_failed", "bad_handshake")


# ----- attack 1 ----------------------------------------------------------------------------------


def test_attack1_a_recorded_join_does_not_replay_into_a_later_run(
    tmp_path: Path, xdg: Path
) -> None:
    secret_file = tmp_path / "secret"
    port = free_port()

    # Run 1 completes normally while the proxy records the walk-in agent's connections.
    with (
        Run(
            tmp_path, name="run1", secret_file=secret_file, port=port, walk_in_ranks=1, xdg=xdg
        ) as run1,
        RecordingProxy(port) as proxy,
    ):
        run1.start_agent(proxy.port)
        run1.wait_connected()
        run1.release(0, 0)
        run1.release(1, 0)
        first, first_agent = run1.finish()
        recordings = proxy.wait_all_closed()
    assert first.returncode == 0, first.stderr
    assert first_agent.returncode == 0, first_agent.stderr
    secret = run1.secret
    by_channel = {r.channel: r for r in recordings}
    assert len(by_channel) == len(recordings)
    assert {Channel.JOIN, Channel.CONTROL} <= set(by_channel)
    join = decode_recording(by_channel[Channel.JOIN], secret=secret, run_id=run1.run_id)
    recorded_hello = join.up[0]
    assert isinstance(recorded_hello, m.JoinHello)
    assert recorded_hello.host == WALK_IN
    recorded_exit = [msg for msg in join.up if isinstance(msg, m.RankExited)]
    assert [(e.round, e.rank, e.exit_code) for e in recorded_exit] == [
        (0, 1, 0)
    ]  # the replay carries "rank 1 exited 0"
    assert isinstance(join.down[0], m.JoinAccept)  # which got the host admitted, that time
    control = decode_recording(by_channel[Channel.CONTROL], secret=secret, run_id=run1.run_id)
    from_ranks = [
        msg for msg in control.up if not (isinstance(msg, m.Heartbeat) and msg.relay)
    ]  # the relay's own beats apart
    assert isinstance(from_ranks[0], m.RankHello)
    assert sum(isinstance(msg, m.Heartbeat) for msg in from_ranks) == 3

    # Run 2: same secret file, same port, a new run. Every recording is replayed before its
    # agent is there (the phantom join), then after StartRanks (the RankExited).
    with Run(
        tmp_path, name="run2", secret_file=secret_file, port=port, walk_in_ranks=1, xdg=xdg
    ) as run2:
        assert run2.secret == secret

        def no_phantom(r: Replayed) -> None:
            doc = run2.status()
            assert _members(doc) == {"localhost": [0]}, f"after the {r}"
            assert doc["joined_ranks"] == 1
            assert doc["phase"] == "waiting"

        before = _replay_all(port, recordings, after_each=no_phantom)
        run2.start_agent(port)  # the real agent of run 2, under the same host name
        connected = run2.wait_connected()
        assert _members(connected) == {"localhost": [0], WALK_IN: [1]}
        run2.release(0, 0)
        running = run2.status(lambda d: d["ranks"][0]["state"] == "exited")

        def rank1_still_runs(r: Replayed) -> None:
            doc = run2.status()
            assert doc["phase"] == "training", f"after the {r}: {doc['verdict']}"
            assert doc["exit_code"] is None
            assert _ranks(doc) == _ranks(running), f"after the {r}"
            assert _members(doc) == {"localhost": [0], WALK_IN: [1]}

        after = _replay_all(port, recordings, after_each=rank1_still_runs)
        replays = before + after
        counted = run2.status(lambda d: _refused(d, *HANDSHAKE_FAILURES) >= len(replays))
        run2.release(1, 3)  # rank 1 really fails; the replayed bytes said it exited 0
        second, second_agent = run2.finish()

    _assert_refused_without_a_frame(before + after)
    assert second.returncode == 4, second.stderr  # a rank failed: not 0
    assert "rank 1 (local rank 0) on host 'walk-in' exited with code 3" in second.stderr
    assert second.stderr.count(f'host "{WALK_IN}" joined with ranks 1 ') == 1
    assert "join refused" not in second.stderr
    assert second_agent.returncode == 4, (
        second_agent.stderr
    )  # it was in the run, and the run failed
    # Each replay was counted as a failed handshake (the paced ones as a bad proof), and summarised, not logged one by one.
    assert _refused(counted, *HANDSHAKE_FAILURES) == len(replays)
    assert _refused(counted, "auth_failed") >= sum(r.how == "paced" for r in replays)
    assert "port mux: refused" in second.stderr


# ----- one live run for attacks 2 and 3 ------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Live:
    run: Run
    proxy: RecordingProxy
    secret: bytes
    connected: Status

    def recording(self, channel: Channel) -> Recorded:
        (found,) = [r for r in self.proxy.recordings() if r.channel is channel]
        return found


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, xdg: Path) -> Iterator[Live]:
    """A run whose walk-in agent (ranks 1 and 2) is recorded through the proxy; it must still end 0 after the attacks."""
    base = tmp_path_factory.mktemp("live")
    port = free_port()
    with (
        Run(
            base, name="live", secret_file=base / "secret", port=port, walk_in_ranks=2, xdg=xdg
        ) as run,
        RecordingProxy(port) as proxy,
    ):
        run.start_agent(proxy.port)
        connected = run.wait_connected()
        yield Live(run=run, proxy=proxy, secret=run.secret, connected=connected)
        for rank in range(run.world_size):
            run.release(rank, 0)
        done, agent = run.finish()
    assert done.returncode == 0, done.stderr  # the attacked run was undisturbed
    assert agent.returncode == 0, agent.stderr


# ----- attack 2 ----------------------------------------------------------------------------------


def test_attack2_recorded_control_frames_do_not_replay_on_a_new_connection(live: Live) -> None:
    run = live.run
    upstream = live.recording(Channel.CONTROL)  # the walk-in relay's upstream, still open
    assert not upstream.closed
    decoded = decode_recording(upstream, secret=live.secret, run_id=run.run_id)
    hellos = {msg.rank: msg.pid for msg in decoded.up if isinstance(msg, m.RankHello)}
    assert hellos == {
        rank: pid for rank, (host, _state, pid) in _ranks(live.connected).items() if host == WALK_IN
    }
    assert (
        sum(isinstance(msg, m.Heartbeat) and not msg.relay for msg in decoded.up) == 6
    )  # the ranks' (the relay beats too, apart)
    assert sorted(msg.rank for msg in decoded.down if isinstance(msg, m.RankWelcome)) == [1, 2]
    refused_before = _refused(run.status(), *HANDSHAKE_FAILURES)

    def unchanged(r: Replayed) -> None:
        doc = run.status()
        assert _ranks(doc) == _ranks(live.connected), (
            f"after the {r}"
        )  # the pids RankHello set, and the states
        assert doc["phase"] == "training"
        assert _members(doc) == _members(live.connected)

    replayed = _replay_all(run.port, [upstream, live.recording(Channel.JOIN)], after_each=unchanged)
    _assert_refused_without_a_frame(replayed)
    counted = run.status(
        lambda d: _refused(d, *HANDSHAKE_FAILURES) >= refused_before + len(replayed)
    )
    assert _refused(counted, *HANDSHAKE_FAILURES) == refused_before + len(replayed)


# ----- attack 3 ----------------------------------------------------------------------------------

#: A frame each controller channel would act on, sent by the insistent client behind its proof.
_ACTIONABLE: dict[Channel, list[Message]] = {
    Channel.JOIN: [
        m.JoinHello(
            host="from-a-rank", devices=("cpu:0",), pid=os.getpid(), agent_version=__version__
        )
    ],
    Channel.RENDEZVOUS: [m.StoreAddress(round=0, host="127.0.0.1", port=9)],
    Channel.CONTROL: [m.RankHello(rank=1, local_rank=0, world_size=3, pid=os.getpid())],
    Channel.DATA: [],  # no service this run: the mux closes it before any handshake
}
#: The framed channels this run serves, and those it does not (the store rides the port itself; the framed
#: rendezvous channel exists only under FLODL_STORE_BACKEND=torch): those are closed before any handshake.
_FRAMED = (Channel.JOIN, Channel.CONTROL)
_UNSERVED = (Channel.RENDEZVOUS, Channel.DATA)


async def _open_each(
    dial: Callable[..., Awaitable[FramedProtocol]], credentials: list[Credential]
) -> list[BaseException | None]:
    """``dial(credential=...)`` (a real ``open_framed``/``open_unix_framed``) with each credential; what each raised (None: let in)."""
    outcomes: list[BaseException | None] = []
    for credential in credentials:
        try:
            async with asyncio.timeout(10):
                link = await dial(credential=credential)
        except (WireError, ConnectionClosed, OSError) as exc:
            outcomes.append(exc)
        else:
            await link.aclose()
            outcomes.append(None)
    return outcomes


def _environ(pid: int) -> bytes:
    return Path(f"/proc/{pid}/environ").read_bytes()


def test_attack3_ranks_hold_a_credential_that_opens_nothing_but_their_own_relay_link(
    live: Live,
) -> None:
    run, secret = live.run, live.secret
    before = run.status()
    ranks = _ranks(before)

    # The rank's environment, and a child's, carry no trace of the secret; the spec holds the rank's credential.
    specs: dict[int, RankSpec] = {}
    for rank, (_host, _state, pid) in ranks.items():
        assert pid is not None
        raw = _environ(pid)
        child = (run.ranks_dir / f"env-{rank}.json").read_text()
        for text in (raw.decode(errors="replace"), child):
            assert secret.hex() not in text.lower()
        assert secret not in raw
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        specs[rank] = RankSpec.from_json(env[RANK_VAR.encode()].decode())
        assert (
            specs[rank].credential_hex
            == Credential.for_rank(secret, run_id=run.run_id, round=0, rank=rank).key.hex()
        )
    spec = specs[1]
    credential = Credential.rank_from_hex(spec.credential_hex, round=spec.round, rank=1)
    assert credential.key != secret
    as_session = [
        Credential(kind=CredentialKind.SESSION, key=credential.key[i : i + SECRET_BYTES])
        for i in range(len(credential.key) - SECRET_BYTES + 1)
    ]
    as_session.append(
        Credential(kind=CredentialKind.SESSION, key=credential.key)
    )  # all of it, as a (longer) secret

    # Every channel of the controller port, with the credential as itself and every slice of it as the secret.
    dropped_no_handler = before["connections"]["dropped"].get(
        "no_handler", 0
    )  # none yet: nothing else dials those channels
    refused_before = {
        reason: _refused(before, reason) for reason in ("refused_credential", *HANDSHAKE_FAILURES)
    }
    # Each attempt dials from an address of its own (127/8): dozens of failed proofs in a row from
    # one address would be slowed by the controller's proof throttle, which is not what this
    # attack is about (test_floods.py is).
    sources = (f"127.0.{n // 250}.{n % 250 + 2}" for n in itertools.count(1000))

    async def dial_port(*, credential: Credential, channel: Channel) -> FramedProtocol:
        return await open_framed(
            "127.0.0.1", run.port, channel=channel, credential=credential, source=next(sources)
        )

    for channel in (*_FRAMED, *_UNSERVED):
        outcomes = asyncio.run(
            _open_each(functools.partial(dial_port, channel=channel), [credential, *as_session])
        )
        if channel in _UNSERVED:  # routed nowhere: closed before a hello could be answered
            assert all(
                isinstance(exc, HandshakeFailed | ConnectionClosed | OSError) for exc in outcomes
            ), outcomes
            continue
        refused, *failed = outcomes
        assert isinstance(refused, HandshakeRefused), refused
        assert (
            "a rank credential is not accepted here: the controller port takes the session secret only"
            in str(refused)
        )
        for exc in failed:
            assert isinstance(exc, AuthenticationFailed), exc
            assert "the server's handshake proof did not verify" in str(exc)
        # The same slices from a client that ignores the server's proof and sends its own, and a frame behind it.
        for key in as_session:
            insisted = insist_on_port(
                run.port, channel, key, _ACTIONABLE[channel], source=next(sources)
            )
            assert insisted.hello is not None
            assert insisted.hello.accepted
            assert insisted.frames == [], f"{channel.value}: {insisted.frames}"
            assert insisted.closed
    for channel in _UNSERVED:
        for key in as_session:
            insisted = insist_on_port(run.port, channel, key, [], source=next(sources))
            assert insisted.hello is None
            assert insisted.closed
    # The insistent client is a faithful one: with the real secret, its heartbeat is echoed.
    control = insist_on_port(
        run.port, Channel.CONTROL, Credential.session(secret), [m.Heartbeat(sent_at=4.25, rank=-1)]
    )
    assert control.frames == [m.Heartbeat(sent_at=4.25, rank=-1)]

    # The relay's socket: the credential works as itself (rank 1, round 0) and as nothing else.
    path = spec.relay_socket
    dial = functools.partial(
        open_unix_framed, path, channel=Channel.CONTROL, peer_label="relay under attack"
    )

    def scoped(*, rank: int, round_: int) -> Credential:
        return Credential(kind=CredentialKind.RANK, key=credential.key, round=round_, rank=rank)

    own, other_rank, other_host, next_round, *sessions = asyncio.run(
        _open_each(
            dial,
            [
                credential,
                scoped(rank=2, round_=0),
                scoped(rank=0, round_=0),
                scoped(rank=1, round_=1),
                *as_session,
            ],
        )
    )
    assert own is None  # a genuine credential: the refusals below are about its scope
    assert isinstance(other_rank, AuthenticationFailed), (
        other_rank
    )  # the relay derived rank 2's key, which we lack
    assert isinstance(other_host, HandshakeRefused), other_host
    assert "rank 0 does not run on this host (its ranks: [1, 2])" in str(other_host)
    assert isinstance(next_round, HandshakeRefused), next_round
    assert "a credential of round 1, but this host runs round 0" in str(next_round)
    for exc in sessions:
        assert isinstance(exc, HandshakeRefused), exc
        assert "a relay takes rank credentials only, not a session credential" in str(exc)
    insisted = insist_on_unix(
        path,
        scoped(rank=2, round_=0),
        [m.RankHello(rank=2, local_rank=1, world_size=3, pid=os.getpid())],
    )
    assert insisted.hello is not None
    assert insisted.hello.accepted
    assert insisted.frames == []
    assert insisted.closed

    # The run is undisturbed: same members, same ranks and pids; every refusal was logged, DATA ones counted.
    after = run.status()
    assert after["phase"] == "training"
    assert _ranks(after) == ranks
    assert _members(after) == _members(before)
    # open_framed with each credential, then insisting with each slice, on each channel this run does not serve
    data_attempts = len(_UNSERVED) * ((1 + len(as_session)) + len(as_session))
    counted = run.status(
        lambda d: (
            d["connections"]["dropped"].get("no_handler", 0) - dropped_no_handler >= data_attempts
        )
    )
    assert counted["connections"]["dropped"]["no_handler"] - dropped_no_handler == data_attempts
    slices = len(_FRAMED) * len(as_session)
    expected = {
        "refused_credential": len(
            _FRAMED
        ),  # the credential as itself, refused by name on each channel
        "auth_failed": slices,  # each insistent client's made-up proof, caught by the server
        "bad_handshake": slices,  # each open_framed that stopped at the server's proof and closed
    }
    counted = run.status(
        lambda d: all(_refused(d, r) - refused_before[r] >= n for r, n in expected.items())
    )
    assert {r: _refused(counted, r) - refused_before[r] for r in expected} == expected
    assert run.agent is not None
    assert BAD_PROOF in run.agent.stderr()  # the relay's own refusal of the insistent rank-2 claim


# ----- counted, and bounded in time ---------------------------------------------------------------


def _counted_rejections(doc: Status) -> int:
    groups = doc["connections"].values()
    return sum(
        group.get(reason, 0) for group in groups for reason in ("auth_failed", "bad_handshake")
    )


def test_failed_handshakes_are_counted_by_reason_in_the_status(live: Live) -> None:
    answer = replay_paced(live.run.port, live.recording(Channel.CONTROL).client)
    assert answer.hello
    assert answer.at_most_a_hello
    live.run.status(
        lambda d: _counted_rejections(d) >= 1, timeout=1.5
    )  # served counters are at most 0.5 s old


def test_a_replayed_hello_without_its_proof_is_closed_at_the_handshake_deadline(live: Live) -> None:
    recorded = live.recording(Channel.JOIN).client
    with connect(live.run.port) as sock:
        send_all(sock, recorded[: client_hello_end(recorded)])
        hello, extra = read_server_hello(sock)
        assert hello
        assert not extra
        assert read_until_closed(sock, within=Deadlines.resolve().handshake + 2.0) == b""
