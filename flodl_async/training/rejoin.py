"""A lost rank restarted by its agent: which hello may rejoin the run, and what the run says of it.

Theory of operation. A rank lost to a crash may be restarted alone by its agent (``--max-restarts
N``, counted over the whole run): the same rank number, a new process — a new *incarnation*, which
its ``TrainerHello`` says (0 for the first process, 1, 2, … after). The old incarnation stays dead
for good: a hello whose incarnation is not above every one seen for that rank (a frozen old
process resuming) is refused, and so is one beyond the run's restarts, one that does not match the
run's reference hello (:func:`~flodl_async.training.hellocheck.check_hello`), and one that comes
when the run is ending. An accepted joiner waits for the next round boundary — no round in flight
— where the coordinator admits it: it is alive again, its first round is the next one opened (it
contributes its state at weight 0 and overwrites it with the consensus: the warm start, over the
data channel like the initial parameters), the gate does not wait for it before then, and it gets
work from the next plan. Coverage stays exact: the dead incarnation's windows went back to the pool
at its death, and the joiner trains only what it is planned from then on.

Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..wire import messages as m


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """``rank``'s incarnation ``incarnation`` rejoined at round ``round``, its previous one lost to
    ``reason``."""

    rank: int
    incarnation: int
    round: int
    reason: str

    def text(self) -> str:
        """``rank 1 (incarnation 1) at round 7, after: its process was killed by SIGKILL``."""
        return (
            f"rank {self.rank} (incarnation {self.incarnation}) at round {self.round}, after: "
            f"{self.reason}"
        )


class Rejoins:
    """The incarnations seen, the joiners waiting for a round boundary, the restarts admitted."""

    __slots__ = ("_incarnation", "_pending", "max_restarts", "restarts")

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self._incarnation: dict[int, int] = {}
        self._pending: dict[int, m.TrainerHello] = {}
        self.restarts: list[Restart] = []

    def joined(self, hello: m.TrainerHello) -> None:
        """A first hello of the run: its incarnation is the rank's latest."""
        self._incarnation[hello.rank] = hello.incarnation

    def refusal(self, hello: m.TrainerHello, *, dead: bool, open_: bool) -> str | None:
        """Why ``hello`` (a rank that already joined once) may not rejoin, or None; ``dead``: its
        rank is lost; ``open_``: the run still trains (not stopping, not ending)."""
        rank = hello.rank
        latest = max(self._incarnation.get(rank, 0), self._waiting_incarnation(rank))
        if hello.incarnation <= latest:
            return (
                f"rank {rank} said TrainerHello again as incarnation {hello.incarnation}, not "
                f"newer than incarnation {latest}: an old process is never taken for a new one"
            )
        if not dead:
            return f"rank {rank} is not lost: its incarnation {latest} still trains"
        if self.max_restarts <= 0:
            return f"rank {rank} was restarted, but this run restarts no rank (--max-restarts 0)"
        if len(self.restarts) + len(self._pending) >= self.max_restarts:
            return f"this run's {self.max_restarts} restart(s) are used up"
        if not open_:
            return "this run's training is ending; a restarted rank cannot rejoin it now"
        return None

    def _waiting_incarnation(self, rank: int) -> int:
        hello = self._pending.get(rank)
        return -1 if hello is None else hello.incarnation

    def wait(self, hello: m.TrainerHello) -> None:
        """``hello`` is accepted: it rejoins at the next round boundary."""
        self._pending[hello.rank] = hello
        self._incarnation[hello.rank] = hello.incarnation

    @property
    def pending(self) -> tuple[int, ...]:
        """The ranks waiting for a round boundary, in order."""
        return tuple(sorted(self._pending))

    def admit(self, rank: int, *, round_: int, reason: str) -> Restart:
        """The waiting ``rank`` rejoins at round ``round_`` (its previous incarnation lost to
        ``reason``)."""
        hello = self._pending.pop(rank)
        restart = Restart(rank=rank, incarnation=hello.incarnation, round=round_, reason=reason)
        self.restarts.append(restart)
        return restart

    def summary(self) -> str:
        """``1 restart (rank 1 …)``, or empty."""
        if not self.restarts:
            return ""
        n = len(self.restarts)
        listed = "; ".join(r.text() for r in self.restarts)
        return f"{n} restart{'s' if n > 1 else ''} ({listed})"
