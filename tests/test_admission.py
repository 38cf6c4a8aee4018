"""The admission core, pure: caps per peer and in total, oldest evicted, deadlines, tickets, the rejection summary."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_async.errors import (
    AuthenticationFailed,
    ConfigError,
    FrameTooLarge,
    HandshakeFailed,
    HandshakeRefused,
    VersionMismatch,
    WireError,
    WrongToken,
)
from flodl_async.net.admission import (
    Admission,
    AdmissionLimits,
    AdmissionTicket,
    Cap,
    Eviction,
    Expired,
    Pool,
    Refused,
    Stage,
    TicketState,
    peer_key,
    rejection_reason,
)
from flodl_async.net.refusals import RejectionSummary, SummaryLine

SMALL = AdmissionLimits(
    max_unauthenticated=6, max_unauthenticated_per_peer=3, max_status=4, max_status_per_peer=2
)


def _core(limits: AdmissionLimits = SMALL) -> Admission:
    return Admission(limits, sniff_timeout=5.0, handshake_timeout=2.0)


# ----- caps and eviction ----------------------------------------------------------------------------


def test_the_per_peer_cap_evicts_that_peers_oldest() -> None:
    core = _core()
    assert [core.admit(i, "a", 0.0) for i in range(3)] == [None, None, None]
    core.admit(10, "b", 0.0)
    assert core.admit(3, "a", 1.0) == Eviction(
        conn=0, peer="a", pool=Pool.UNAUTHENTICATED, cap=Cap.PER_PEER, limit=3
    )
    assert core.count(Pool.UNAUTHENTICATED, "a") == 3
    assert core.stage(10) is Stage.SNIFFING  # the other peer is untouched
    assert core.stage(0) is None


def test_the_total_cap_evicts_the_oldest_overall() -> None:
    core = _core()
    for i, peer in enumerate("abcdef"):
        assert core.admit(i, peer, 0.0) is None
    eviction = core.admit(6, "g", 0.0)
    assert eviction == Eviction(conn=0, peer="a", pool=Pool.UNAUTHENTICATED, cap=Cap.TOTAL, limit=6)
    assert (
        eviction.describe()
        == "evicting the oldest unauthenticated connections: more than 6 in total"
    )
    assert core.count(Pool.UNAUTHENTICATED) == 6


def test_an_authenticated_connection_leaves_admission() -> None:
    core = _core()
    core.admit(0, "a", 0.0)
    core.handshake(0, 1.0)
    assert core.release(0) is Stage.HANDSHAKING  # the protocol said authenticated
    for i in range(1, 20):
        eviction = core.admit(i, "a", 2.0)
        assert eviction is None or eviction.conn != 0
    assert core.stage(0) is None
    assert core.release(0) is None


def test_a_full_cap_evicts_the_silent_before_the_routed_before_the_answered() -> None:
    core = _core()
    core.admit(0, "a", 0.0)
    core.admit(1, "a", 0.0)
    core.admit(2, "a", 0.0)
    core.handshake(0, 1.0)  # routed, hello not yet accepted
    core.handshake(1, 1.0)
    core.answered(1, 1.0, grace=3.0)  # one proof from authenticating, in its grace
    # the oldest silent one goes first, though it arrived after the routed one
    assert core.admit(3, "a", 1.5) == Eviction(
        conn=2, peer="a", pool=Pool.UNAUTHENTICATED, cap=Cap.PER_PEER, limit=3
    )
    assert core.admit(4, "a", 1.5) is not None  # silent 3 goes
    # left: 0 routed, 1 answered, 4 silent: the silent, then the routed, then the answered
    assert [core.admit(i, "a", 2.0).conn for i in (5, 6)] == [4, 5]  # type: ignore[union-attr]
    assert core.admit(7, "a", 2.0).conn == 6  # type: ignore[union-attr]
    assert core.stage(0) is Stage.HANDSHAKING
    assert core.stage(1) is Stage.HANDSHAKING


def test_an_answered_connection_is_evicted_only_when_nothing_else_is_left() -> None:
    core = _core()
    for i in range(3):
        core.admit(i, "a", 0.0)
        core.handshake(i, 0.0)
    core.answered(0, 0.0, grace=3.0)
    core.answered(2, 0.0, grace=3.0)
    assert core.admit(3, "a", 1.0).conn == 1  # type: ignore[union-attr]  # the routed one
    core.handshake(3, 1.0)
    core.answered(3, 1.0, grace=3.0)
    # all three answered, in their grace: the newcomer still gets in, the oldest makes room
    assert core.admit(4, "a", 1.0).conn == 0  # type: ignore[union-attr]


def test_an_answered_connection_past_its_grace_goes_before_a_routed_one() -> None:
    core = _core()
    for i in range(3):
        core.admit(i, "a", 0.0)
        core.handshake(i, 0.0)
    core.answered(2, 0.0, grace=0.5)  # overdue for its proof at 1.0
    assert core.admit(3, "a", 1.0).conn == 2  # type: ignore[union-attr]
    core.handshake(3, 1.0)
    core.answered(0, 1.0, grace=0.5)
    assert core.admit(4, "a", 1.2).conn == 1  # type: ignore[union-attr]  # 0 is in its grace


def test_answered_counts_against_the_total_cap_by_progress_too() -> None:
    core = _core()
    for i, peer in enumerate("abcdef"):
        core.admit(i, peer, 0.0)
        core.handshake(i, 0.0)
        core.answered(i, 0.0, grace=5.0)
    assert core.admit(6, "g", 1.0).conn == 0  # type: ignore[union-attr]
    assert core.admit(7, "h", 1.0).conn == 6  # type: ignore[union-attr]  # the silent newcomer
    core.answered(99, 1.0, grace=1.0)  # an untracked connection is ignored


def test_status_has_its_own_budget() -> None:
    core = _core()
    for i in range(3):
        core.admit(i, "a", 0.0)
    assert core.to_status(0) is None
    assert core.to_status(1) is None
    assert (core.count(Pool.STATUS, "a"), core.count(Pool.UNAUTHENTICATED, "a")) == (2, 1)
    eviction = core.to_status(2)
    assert eviction == Eviction(conn=0, peer="a", pool=Pool.STATUS, cap=Cap.PER_PEER, limit=2)
    assert eviction.describe() == "evicting the oldest status connections: more than 2 from a"
    # Status connections never push out unauthenticated ones, nor the other way round.
    for i in range(3, 6):
        assert core.admit(i, "a", 0.0) is None
    assert core.statistics().evicted == {"status": 1}


def test_a_status_cap_of_zero_refuses_and_keeps_the_connection_where_it_was() -> None:
    core = _core(AdmissionLimits(max_status=0, max_status_per_peer=0))
    core.admit(0, "a", 0.0)
    assert core.to_status(0) == Refused(pool=Pool.STATUS)
    assert core.stage(0) is Stage.SNIFFING


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_unauthenticated_per_peer": 0}, "the port must be able to admit its own agents"),
        (
            {"max_unauthenticated": 10, "max_unauthenticated_per_peer": 11},
            r"per peer \(11\) <= unauthenticated in total \(10\)",
        ),
        (
            {"max_status": 4, "max_status_per_peer": 5},
            r"status per peer \(5\) <= status in total \(4\)",
        ),
    ],
)
def test_limits_are_checked(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AdmissionLimits(**kwargs)


def test_readmitting_a_connection_is_a_bug() -> None:
    core = _core()
    core.admit(0, "a", 0.0)
    with pytest.raises(ValueError, match="already admitted"):
        core.admit(0, "a", 0.0)
    core.handshake(0, 0.0)
    with pytest.raises(ValueError, match="is handshaking, not sniffing"):
        core.handshake(0, 0.0)
    with pytest.raises(ValueError, match="is handshaking, not sniffing"):
        core.to_status(0)


# ----- deadlines -------------------------------------------------------------------------------------


def test_each_stage_has_its_deadline() -> None:
    core = _core()
    assert core.next_deadline() is None
    core.admit(0, "a", 0.0)  # sniff deadline 5
    core.admit(1, "b", 1.0)  # 6
    core.handshake(1, 2.0)  # handshake deadline 4: now the earliest
    assert core.next_deadline() == 4.0
    assert core.expire(3.9) == []
    assert core.expire(4.0) == [Expired(conn=1, stage=Stage.HANDSHAKING)]
    assert core.next_deadline() == 5.0
    assert core.expire(100.0) == [Expired(conn=0, stage=Stage.SNIFFING)]
    assert core.next_deadline() is None


def test_released_and_status_connections_have_no_deadline() -> None:
    core = _core()
    core.admit(0, "a", 0.0)
    core.admit(1, "a", 0.0)
    core.to_status(0)
    core.release(1)
    assert core.next_deadline() is None
    assert core.expire(1e9) == []
    assert core.stage(0) is Stage.STATUS


# ----- properties: against a model, under any sequence of operations --------------------------------

PEERS = st.sampled_from(["a", "b", "c", "d"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), PEERS),
        st.tuples(st.just("handshake"), st.integers(0, 60)),
        st.tuples(st.just("answer"), st.integers(0, 60)),
        st.tuples(st.just("status"), st.integers(0, 60)),
        st.tuples(st.just("authenticate"), st.integers(0, 60)),
        st.tuples(st.just("close"), st.integers(0, 60)),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
    ),
    max_size=120,
)
LIMITS = st.builds(
    lambda total, per_peer, status, status_per_peer: AdmissionLimits(
        max_unauthenticated=total,
        max_unauthenticated_per_peer=min(per_peer, total),
        max_status=status,
        max_status_per_peer=min(status_per_peer, status),
    ),
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(0, 5),
    st.integers(0, 5),
)


@settings(max_examples=300, deadline=None)
@given(limits=LIMITS, ops=OPS)
def test_caps_hold_newcomers_get_in_and_the_authenticated_are_never_evicted(
    limits: AdmissionLimits, ops: list[tuple[str, object]]
) -> None:
    core = Admission(limits, sniff_timeout=5.0, handshake_timeout=2.0)
    model: dict[int, tuple[str, Stage]] = {}  # what should be tracked
    authenticated: set[int] = set()
    now, next_id, evictions = 0.0, 0, 0
    for op, arg in ops:
        if op == "admit":
            conn, next_id = next_id, next_id + 1
            silent = {c for c, (p, stage) in model.items() if stage is Stage.SNIFFING}
            eviction = core.admit(conn, str(arg), now)
            if eviction is not None:
                assert eviction.conn in model
                # the least progressed go first: one that sent nothing, if its scope holds one
                scope = {c for c in silent if eviction.cap is Cap.TOTAL or model[c][0] == arg}
                assert not scope or eviction.conn in scope
                assert eviction.conn == min(scope, default=eviction.conn)
                assert eviction.conn not in authenticated
                assert model.pop(eviction.conn)[1] is not Stage.STATUS
                evictions += 1
            model[conn] = (str(arg), Stage.SNIFFING)
            assert core.stage(conn) is Stage.SNIFFING  # the newcomer always gets in
        elif (
            op in ("handshake", "status")
            and model.get(int(str(arg)), ("", None))[1] is Stage.SNIFFING
        ):
            conn = int(str(arg))
            if op == "handshake":
                core.handshake(conn, now)
                model[conn] = (model[conn][0], Stage.HANDSHAKING)
            else:
                outcome = core.to_status(conn)
                if isinstance(outcome, Refused):
                    assert limits.max_status_per_peer == 0
                    continue
                if outcome is not None:
                    assert model.pop(outcome.conn)[1] is Stage.STATUS
                model[conn] = (model[conn][0], Stage.STATUS)
        elif op == "answer" and model.get(int(str(arg)), ("", None))[1] is Stage.HANDSHAKING:
            core.answered(int(str(arg)), now, grace=1.0)
        elif op == "authenticate" and model.get(int(str(arg)), ("", None))[1] is Stage.HANDSHAKING:
            conn = int(str(arg))
            assert core.release(conn) is Stage.HANDSHAKING
            del model[conn]
            authenticated.add(conn)
        elif op == "close":
            conn = int(str(arg))
            assert core.release(conn) == (model.pop(conn)[1] if conn in model else None)
        elif op == "tick":
            now += float(str(arg))
            for expired in core.expire(now):
                assert model.pop(expired.conn)[1] is expired.stage
        # Invariants after every step: the caps hold, and the core tracks exactly the model.
        for pool in Pool:
            assert core.count(pool) <= limits.cap(pool, Cap.TOTAL)
            for peer in "abcd":
                assert core.count(pool, peer) <= limits.cap(pool, Cap.PER_PEER)
        assert {c: core.stage(c) for c in core.conns()} == {
            c: stage for c, (_, stage) in model.items()
        }
        assert not authenticated & set(core.conns())
    assert sum(core.statistics().evicted.values()) >= evictions


# ----- peer keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("10.0.0.5", "10.0.0.5"),
        ("127.0.0.2", "127.0.0.2"),
        ("::1", "::1"),
        ("::ffff:10.0.0.5", "10.0.0.5"),
        ("2001:db8::1", "2001:db8::/64"),
        ("2001:db8::ffff:1", "2001:db8::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("", "local"),
    ],
)
def test_peer_keys(host: str, key: str) -> None:
    assert peer_key(host) == key


# ----- tickets ---------------------------------------------------------------------------------------


def _ticket() -> tuple[AdmissionTicket, list[tuple[str, ...]]]:
    calls: list[tuple[str, ...]] = []
    ticket = AdmissionTicket(
        on_authenticated=lambda: calls.append(("authenticated",)),
        on_rejected=lambda r, d: calls.append(("rejected", r, d)),
    )
    return ticket, calls


def test_a_ticket_reports_authenticated_once() -> None:
    ticket, calls = _ticket()
    ticket.authenticated()
    ticket.authenticated()
    assert calls == [("authenticated",)]
    assert ticket.state is TicketState.AUTHENTICATED


def test_a_ticket_reports_one_rejection_even_after_authenticating() -> None:
    ticket, calls = _ticket()
    ticket.authenticated()
    ticket.rejected("bad_frame", "tag did not verify")
    ticket.rejected("bad_frame", "again")
    ticket.authenticated()
    assert calls == [("authenticated",), ("rejected", "bad_frame", "tag did not verify")]
    assert ticket.state is TicketState.REJECTED


def test_a_rejected_ticket_cannot_authenticate() -> None:
    ticket, calls = _ticket()
    ticket.rejected("auth_failed", "wrong key")
    ticket.authenticated()
    assert calls == [("rejected", "auth_failed", "wrong key")]


# ----- the rejection summary -------------------------------------------------------------------------


def test_the_first_refusal_is_reported_at_once_then_summed_per_interval() -> None:
    summary = RejectionSummary(interval=10.0)
    summary.record("unknown_magic", 100.0)
    line = summary.due(100.0)
    assert line is not None
    assert line.text == "port mux: refused 1 connection: 1 unknown_magic; continuing to accept"
    assert not line.warning
    for i in range(65000):
        summary.record("handshake_timeout", 100.5 + i * 1e-4)
    for _ in range(1123):
        summary.record("unknown_magic", 107.0)
    assert summary.due(109.9) is None
    assert summary.next_due() == 110.0
    line = summary.due(110.5)
    assert line is not None
    assert (
        line.text
        == "port mux: refused 66123 connections in the last 10 s: 65000 handshake_timeout, 1123 unknown_magic; continuing to accept"
    )
    assert summary.due(110.5) is None
    assert summary.next_due() is None
    assert summary.totals() == {"unknown_magic": 1124, "handshake_timeout": 65000}


def test_notes_make_a_warning_and_are_counted() -> None:
    summary = RejectionSummary(interval=10.0)
    summary.record(
        "evicted",
        0.0,
        note="evicting the oldest unauthenticated connections: more than 64 from 10.0.0.5",
    )
    line = summary.due(0.0)
    assert line is not None
    assert line.warning
    assert line.text == (
        "port mux: refused 1 connection: 1 evicted; evicting the oldest unauthenticated connections: more than 64 from 10.0.0.5; continuing to accept"
    )
    for _ in range(5):
        summary.note("accept() failed: out of file descriptors", 1.0)
    line = summary.due(11.0)
    assert line is not None
    assert line.warning
    assert (
        line.text
        == "port mux: accept() failed: out of file descriptors (5×) in the last 10 s; continuing to accept"
    )


def test_notes_are_bounded_per_line() -> None:
    summary = RejectionSummary(interval=1.0, max_notes=4)
    for i in range(100):
        summary.record("evicted", 0.0, note=f"more than 64 from 10.0.0.{i % 20}")
    line = summary.flush(0.0)
    assert line is not None
    assert line.text.count("more than 64 from") == 3
    assert (
        "85 more for other reasons" in line.text
    )  # 100 refusals, 5 each shown for three addresses


@settings(max_examples=200, deadline=None)
@given(
    interval=st.floats(0.1, 30.0),
    events=st.lists(
        st.tuples(
            st.floats(0.0, 5.0), st.sampled_from(["unknown_magic", "evicted", "handshake_timeout"])
        ),
        max_size=200,
    ),
)
def test_at_most_one_line_per_interval_and_every_refusal_reported(
    interval: float, events: list[tuple[float, str]]
) -> None:
    summary = RejectionSummary(interval=interval)
    now, emitted, reported = 0.0, [], 0
    for step, reason in events:
        now += step
        # The shell asks when a line falls due, as its timer would, before the next event.
        at = summary.next_due()
        if at is not None and at <= now:
            line = summary.due(at)
            assert line is not None
            emitted.append((at, line))
        summary.record(reason, now)
        line = summary.due(now)
        if line is not None:
            emitted.append((now, line))
    final = summary.flush(now + interval)
    lines = [line for _, line in emitted] + ([final] if final is not None else [])
    for (a, _), (b, _) in itertools.pairwise(emitted):
        assert b - a >= interval - 1e-9
    for line in lines:
        reported += int(re.search(r"refused (\d+) connection", line.text).group(1))  # type: ignore[union-attr]
    assert reported == len(events)
    assert sum(summary.totals().values()) == len(events)


# ----- what callers read back -----------------------------------------------------------------------


def test_the_status_budget_has_a_total_cap_above_its_per_peer_cap() -> None:
    core = _core(AdmissionLimits(max_status=2, max_status_per_peer=1))
    for conn, peer in enumerate("abc"):
        core.admit(conn, peer, 0.0)
    assert core.to_status(0) is None
    assert core.to_status(1) is None  # another peer: room left in total
    eviction = core.to_status(2)
    assert eviction == Eviction(conn=0, peer="a", pool=Pool.STATUS, cap=Cap.TOTAL, limit=2)
    assert eviction.describe() == "evicting the oldest status connections: more than 2 in total"


def test_statistics_count_each_stage() -> None:
    core = _core()
    for conn in range(5):
        core.admit(conn, f"peer{conn}", 0.0)
    core.handshake(0, 0.0)
    core.to_status(1)
    core.to_status(2)
    core.to_status(3)
    stats = core.statistics()
    assert (stats.sniffing, stats.handshaking, stats.status) == (1, 1, 3)
    assert stats.evicted == {}


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (VersionMismatch("v2"), "version_mismatch"),
        (WrongToken("proof"), "wrong_token"),  # before its base class, AuthenticationFailed
        (AuthenticationFailed("tag"), "auth_failed"),
        (HandshakeRefused("credential"), "refused_credential"),  # before HandshakeFailed
        (HandshakeFailed("cut short"), "bad_handshake"),
        (FrameTooLarge("2 GiB"), "bad_frame"),
        (WireError("anything else"), "bad_frame"),
    ],
)
def test_each_wire_error_is_refused_under_its_own_counter(exc: WireError, reason: str) -> None:
    assert rejection_reason(exc) == reason


def test_reasons_are_listed_most_frequent_first_then_by_name() -> None:
    summary = RejectionSummary()
    summary.record("wrong_token", 0.0)
    for _ in range(2):
        summary.record("bad_frame", 0.0)
    summary.record("unknown_magic", 0.0)
    summary.record("auth_failed", 0.0)
    line = summary.flush(0.0)
    assert line is not None
    assert line.text == (
        "port mux: refused 5 connections: 2 bad_frame, 1 auth_failed, 1 unknown_magic, "
        "1 wrong_token; continuing to accept"
    )


def test_notes_are_shown_most_frequent_first_then_by_text() -> None:
    summary = RejectionSummary()
    for text in ["d once", "c once", "b twice", "b twice", "a once"]:
        summary.note(text, 0.0)
    line = summary.flush(0.0)
    assert line is not None
    # the three shown: the most frequent, then the first two by text; one more is counted
    assert line.text == (
        "port mux: b twice (2×); a once; c once; 1 more for other reasons; continuing to accept"
    )


def test_a_note_arriving_when_the_line_is_full_is_counted_not_kept() -> None:
    summary = RejectionSummary(max_notes=1)
    summary.note("kept", 0.0)
    for _ in range(3):
        summary.note("late", 0.0)  # more frequent, yet the line had no room for it
    line = summary.flush(0.0)
    assert line is not None
    assert line.text == "port mux: kept; 3 more for other reasons; continuing to accept"


def test_a_note_is_a_warning_even_when_the_line_has_no_room_to_show_it() -> None:
    summary = RejectionSummary(max_notes=0)
    summary.note("accept() failed: out of file descriptors", 0.0)
    line = summary.flush(0.0)
    assert line == SummaryLine(
        text="port mux: 1 more for other reasons; continuing to accept", warning=True
    )


@pytest.mark.parametrize(
    ("window", "span"),
    [(0.0, ""), (0.049, ""), (0.05, " in the last 0.05 s"), (0.5, " in the last 0.5 s")],
)
def test_the_span_is_named_once_it_is_long_enough_to_read(window: float, span: str) -> None:
    summary = RejectionSummary()
    summary.record("bad_frame", 0.0)
    line = summary.flush(window)
    assert line is not None
    assert line.text == f"port mux: refused 1 connection{span}: 1 bad_frame; continuing to accept"
