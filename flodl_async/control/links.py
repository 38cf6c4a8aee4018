"""The controller's book of control links per host, and the liveness of the relays' own links (pure:
``now`` passed in).

A host's relay holds one upstream control link (ranks of the torch store backend may add their
own). A link is bound to a host by the first rank it names (a relay beat or a RankHello), since
the session credential it speaks with is every host's. Two rules follow, which the shell carries
out:

- a host lost for any reason loses its control links with it (:meth:`ControlLinks.drop` names them
  for the shell to abort), instead of the controller holding dead TCP connections until teardown;
- a relay link that beats (``Heartbeat(relay=True)``) and then goes silent past the deadline loses
  its host (:meth:`ControlLinks.silent_hosts`) — unless that host is silent on its join link too,
  when the join link, expiring now or within a beat, names it with the usual reason.

Links are opaque keys here (the shell's framed links); nothing is sent or closed from this module.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Generic, TypeVar

from .liveness import Liveness

L = TypeVar("L", bound=Hashable)


class ControlLinks(Generic[L]):
    """Which control links belong to which host, and how live each beating relay link is."""

    def __init__(self, *, interval: float, silence: float) -> None:
        self._interval = interval
        self._silence = silence
        self._by_host: dict[str, set[L]] = {}
        self._relays: dict[L, tuple[str, Liveness]] = {}

    def bind(self, link: L, host: str) -> None:
        """``link`` carries ``host``'s ranks from now on."""
        self._by_host.setdefault(host, set()).add(link)

    def heard(self, link: L, host: str, now: float) -> None:
        """A relay beat on ``link`` (bound to ``host``): it is watched from its first beat on."""
        held = self._relays.get(link)
        self._relays[link] = (
            host,
            held[1].heard(now)
            if held is not None
            else Liveness.start(now, interval=self._interval, silence=self._silence),
        )

    def closed(self, link: L, host: str | None) -> None:
        """``link`` ended (its reader returned)."""
        self._relays.pop(link, None)
        if host is not None:
            self._by_host.get(host, set()).discard(link)

    def drop(self, host: str) -> set[L]:
        """``host`` is lost: forget its links and return them (the shell aborts them)."""
        links = self._by_host.pop(host, set())
        for link in links:
            self._relays.pop(link, None)  # lost already: its silence must not lose the host twice
        return links

    def excused(self, now: float) -> None:
        """This process was frozen: no relay could be heard meanwhile."""
        self._relays = {
            link: (host, live.excused(now)) for link, (host, live) in self._relays.items()
        }

    def next_deadline(self) -> float | None:
        """When a relay link could next go silent past the deadline."""
        return min((live.expires_at() for _host, live in self._relays.values()), default=None)

    def silent_hosts(self, now: float, join_liveness: Mapping[str, Liveness]) -> list[str]:
        """Hosts lost by their relay link's silence now (each once); their links are forgotten, not
        yet dropped."""
        lost: list[str] = []
        for link, (host, live) in list(self._relays.items()):
            if not live.expired(now):
                continue
            joined = join_liveness.get(host)
            if joined is not None and joined.silent_for(now) > self._interval:
                # Silent on its join link too: that one names the host (now or within a beat); wait
                # for it.
                self._relays[link] = (host, live.heard(joined.last_heard))
                continue
            del self._relays[link]
            if host not in lost:
                lost.append(host)
        return lost
