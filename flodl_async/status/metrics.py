"""``/metrics``: the run in Prometheus' text exposition format, a fixed and documented set.

Theory of operation
-------------------
:class:`RunMetrics` is a sink of the board's event stream (:meth:`RunMetrics.observe`, O(1) per
event, plain Python): it keeps the counters and histogram buckets that only events can tell
(rounds, epochs, recoveries, checkpoints). Everything else is read, at scrape time, from the
snapshot the board serves (ranks, restarts, refused connections, the Trainer's block).
:meth:`RunMetrics.exposition` renders both with ``prometheus_client``'s metric families and
``generate_latest`` — no hand-written exposition — and imports ``prometheus_client`` only then:
a run nobody scrapes never loads it, and neither does the launcher's start path.

The set (:data:`METRICS`, also in the README): gauges for values, counters for totals, histograms
for durations. Metrics whose source this version does not have yet are listed in
:data:`NOT_FED` and still exposed (at zero, or with no samples) so that dashboards and alerts
can be written against the fixed set.
"""

from __future__ import annotations

import bisect
import math
import typing
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from .events import (
    CheckpointSaved,
    EpochDone,
    RankRecovered,
    RoundDone,
    ScalarsReported,
    Stamped,
)
from .model import RankState, StatusSnapshot

#: The ``Content-Type`` of ``/metrics``: the text format 0.0.4, which every Prometheus reads.
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

#: Every metric ``/metrics`` exposes: name → (type, help). Counters are named with their
#: ``_total`` suffix, as exposed.
METRICS: Mapping[str, tuple[str, str]] = {
    "flodl_ranks": ("gauge", "Rank processes by state (running, connected, exited, failed)."),
    "flodl_rank_up": ("gauge", "1 while a rank's process runs, else 0; labels rank and host."),
    "flodl_heartbeat_age_seconds": (
        "gauge",
        "Seconds since the Trainer last heard from each rank (Trainer runs only).",
    ),
    "flodl_steps_total": ("counter", "Training steps (batches) reported by all ranks."),
    "flodl_rounds_total": ("counter", "Averaging rounds committed."),
    "flodl_epoch": ("gauge", "Epochs closed so far."),
    "flodl_loss": ("gauge", "Mean training loss of the last round (then of the epoch it closed)."),
    "flodl_step_seconds": ("histogram", "Mean step time of the ranks' batches, one per round."),
    "flodl_reduce_seconds": ("histogram", "Duration of each averaging round's reduce."),
    "flodl_wire_bytes_total": (
        "counter",
        "Bytes carried, by channel and direction (data in: tensor bytes the ranks' relays sent).",
    ),
    "flodl_connections_refused_total": (
        "counter",
        "Connections the port refused or dropped, by reason.",
    ),
    "flodl_restarts_total": ("counter", "World restarts."),
    "flodl_recoveries_total": ("counter", "Ranks the run got over, by kind (regroup, restart)."),
    "flodl_recovery_seconds": ("histogram", "From a rank's death to the run going on without it."),
    "flodl_checkpoint_seconds": ("histogram", "Time to write each checkpoint."),
    "flodl_scalar": (
        "gauge",
        "The latest value of each named scalar a rank reported (fa.report; rank 'all': a Trainer "
        "epoch's average over its ranks).",
    ),
}
#: Distinct (name, rank) series ``flodl_scalar`` keeps: a script that reports ever new names
#: must not grow the scrape (or Prometheus) without bound; later ones are counted, not kept.
MAX_SCALAR_SERIES = 256
#: Metrics exposed with no source in this version: nothing emits checkpoints yet, and only the
#: data channel's inbound tensor bytes are counted.
NOT_FED = ("flodl_checkpoint_seconds",)

_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LONG_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _Histogram:
    """Bucket counts (not cumulative), their sum and count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(bound), float(running)))
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class _Sample:
    labels: Mapping[str, str]
    value: float


class RunMetrics:
    """What only events tell, accumulated; and the exposition of the whole set (see the module)."""

    def __init__(self) -> None:
        self.steps = 0
        self.rounds = 0
        self.epoch = 0
        self.loss: float | None = None
        self.recoveries: Counter[str] = Counter()
        self.step_seconds = _Histogram(_STEP_BUCKETS)
        self.reduce_seconds = _Histogram(_STEP_BUCKETS)
        self.recovery_seconds = _Histogram(_LONG_BUCKETS)
        self.checkpoint_seconds = _Histogram(_LONG_BUCKETS)
        self.scalars: dict[tuple[str, str], float] = {}
        #: Reported values left out for :data:`MAX_SCALAR_SERIES`.
        self.scalars_dropped = 0
        self._registry: object | None = None
        self._snapshot: StatusSnapshot | None = None
        # which events change what (a table, as the codebase dispatches)
        self._takes: dict[type, Callable[[typing.Any], None]] = {
            RoundDone: self._round,
            EpochDone: self._epoch,
            RankRecovered: self._recovered,
            CheckpointSaved: self._checkpoint,
            ScalarsReported: self._reported,
        }

    def observe(self, stamped: Stamped) -> None:
        """One recorded event (the board calls this for every event); most kinds change nothing."""
        take = self._takes.get(type(stamped.event))
        if take is not None:
            take(stamped.event)

    def _round(self, event: RoundDone) -> None:
        self.rounds += 1
        self.steps += event.batches
        self.reduce_seconds.observe(event.reduce_s)
        if event.step_s is not None:
            self.step_seconds.observe(event.step_s)
        if event.loss is not None:
            self.loss = event.loss

    def _epoch(self, event: EpochDone) -> None:
        self.epoch = event.epoch
        self.loss = event.avg_loss
        self._scalars(event.scalars, "all")

    def _reported(self, event: ScalarsReported) -> None:
        self._scalars(event.scalars, str(event.rank))

    def _scalars(self, values: Mapping[str, float], rank: str) -> None:
        for name, value in values.items():
            key = (name, rank)
            if key in self.scalars or len(self.scalars) < MAX_SCALAR_SERIES:
                self.scalars[key] = value
            else:
                self.scalars_dropped += 1

    def _recovered(self, event: RankRecovered) -> None:
        self.recoveries[event.by] += 1
        self.recovery_seconds.observe(event.seconds)

    def _checkpoint(self, event: CheckpointSaved) -> None:
        self.checkpoint_seconds.observe(event.seconds)

    def exposition(self, snapshot: StatusSnapshot | None) -> bytes:
        """The text exposition of :data:`METRICS` as of now (``snapshot``: the served one)."""
        # deferred: start path — prometheus_client loads on the first scrape, never at launch
        from prometheus_client import CollectorRegistry, generate_latest

        if self._registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(self))  # type: ignore[arg-type]
            self._registry = registry
        self._snapshot = snapshot
        return bytes(generate_latest(self._registry))  # type: ignore[arg-type]

    # ----- what each metric holds now ------------------------------------------------------------

    def samples(self, snapshot: StatusSnapshot | None) -> dict[str, list[_Sample]]:
        """The gauge and counter samples, by metric name (histograms are kept apart)."""
        training = (snapshot.training if snapshot is not None else None) or {}
        ranks = snapshot.ranks if snapshot is not None else ()
        by_state = Counter(r.state.value for r in ranks)
        connections = snapshot.connections if snapshot is not None else {}
        dropped = connections.get("dropped", {})
        return {
            "flodl_ranks": [
                _Sample(labels={"state": s.value}, value=by_state[s.value]) for s in RankState
            ],
            "flodl_rank_up": [
                _Sample(
                    labels={"rank": str(r.rank), "host": r.host},
                    value=float(r.state in (RankState.RUNNING, RankState.CONNECTED)),
                )
                for r in ranks
            ],
            "flodl_heartbeat_age_seconds": [
                _Sample(
                    labels={"rank": str(v["rank"]), "host": str(v.get("host", ""))},
                    value=age,
                )
                for v in _records(training.get("ranks"))
                if (age := _number(v.get("heartbeat_age"))) is not None
                and isinstance(v.get("rank"), int)
            ],
            "flodl_steps_total": [_Sample(labels={}, value=self.steps)],
            "flodl_rounds_total": [_Sample(labels={}, value=self.rounds)],
            "flodl_epoch": [_Sample(labels={}, value=max(self.epoch, _int(training.get("epoch"))))],
            "flodl_loss": [] if self.loss is None else [_Sample(labels={}, value=self.loss)],
            "flodl_wire_bytes_total": [
                _Sample(
                    labels={"channel": "data", "direction": "in"},
                    value=sum(
                        _int(u.get("payload_bytes")) for u in _records(training.get("uplinks"))
                    ),
                )
            ],
            "flodl_connections_refused_total": [
                _Sample(labels={"reason": str(reason)}, value=n)
                for reason, n in sorted(dropped.items())
            ],
            "flodl_restarts_total": [
                _Sample(labels={}, value=snapshot.restart_count if snapshot is not None else 0)
            ],
            "flodl_recoveries_total": [
                _Sample(labels={"kind": kind}, value=self.recoveries[kind])
                for kind in ("regroup", "restart")
            ],
            "flodl_scalar": [
                _Sample(labels={"name": name, "rank": rank}, value=value)
                for (name, rank), value in sorted(self.scalars.items())
            ],
        }

    def histograms(self) -> dict[str, _Histogram]:
        """The histograms, by metric name."""
        return {
            "flodl_step_seconds": self.step_seconds,
            "flodl_reduce_seconds": self.reduce_seconds,
            "flodl_recovery_seconds": self.recovery_seconds,
            "flodl_checkpoint_seconds": self.checkpoint_seconds,
        }


class _Collector:
    """prometheus_client's view of a :class:`RunMetrics` (its ``collect`` is called per scrape)."""

    def __init__(self, metrics: RunMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import (  # deferred: start path (see RunMetrics.exposition)
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        families = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        metrics = self._metrics
        samples = metrics.samples(metrics._snapshot)
        histograms = metrics.histograms()
        for name, (kind, text) in METRICS.items():
            if kind == "histogram":
                h = histograms[name]
                yield HistogramMetricFamily(name, text, buckets=h.cumulative(), sum_value=h.sum)
                continue
            rows = samples[name]
            labels = sorted(rows[0].labels) if rows else _LABELS.get(name, [])
            family = families[kind](name, text, labels=labels)
            for row in rows:
                family.add_metric([row.labels[k] for k in labels], row.value)
            yield family


#: Label names of metrics that may have no sample yet.
_LABELS: Mapping[str, list[str]] = {
    "flodl_rank_up": ["host", "rank"],
    "flodl_heartbeat_age_seconds": ["host", "rank"],
    "flodl_connections_refused_total": ["reason"],
    "flodl_scalar": ["name", "rank"],
}


def _records(value: object) -> list[Mapping[str, object]]:
    if not isinstance(value, list | tuple):
        return []
    return [v for v in value if isinstance(v, Mapping)]


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
