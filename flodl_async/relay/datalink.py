"""The rank's data link: contributions to its host's relay, consensus back.

``await DataLink.connect(spec, rank, schema, digest)`` dials the relay's
``data.sock`` with the rank's own credential (its rank, its round) and says
``DataHello``; the relay answers ``DataWelcome`` with the tensor ceiling once the
host's data connection to the controller is up, and only then are tensor frames
accepted both ways. Open it after ``TrainerWelcome`` (the controller serves the
data channel only once its coordinator runs).

``contribute()`` sends this rank's tensors for a round, zero-copy (the frame is
sealed in a worker thread straight from the tensors' memory, so they must not
change until it returns), and waits for the round's consensus. Consensus tensors
view the link's receive buffer: they stay valid until the next ``receive()`` or
``contribute()``; copy them into the model (``copy_``/``lerp_``) before that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from ..config.rankenv import RankSpec
from ..errors import ConnectionClosed, ProtocolError
from ..net.bufpool import BufferPool
from ..net.framed import FramedProtocol, open_unix_framed
from ..training import foldmath
from ..training.modelschema import ModelSchema
from ..wire import messages as m
from ..wire.channels import Channel
from ..wire.frame import FrameLimits
from ..wire.keys import Credential
from ..wire.tensor import tensor_bytes
from .fold import HELLO_LIMITS

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsensusResult:
    """A round's consensus. ``mass == 0``: nothing was realized, ``tensors`` is None — keep the
    local state.

    ``tensors`` are keyed by the schema's wire names (parameters then buffers; aliases of tied
    keys are not repeated) and view the link's receive buffer until the next receive.
    """

    round: int
    kind: str
    mass: float
    tensors: dict[str, torch.Tensor] | None


class DataLink:
    """One rank's data link to its relay."""

    def __init__(
        self, link: FramedProtocol, *, rank: int, schema: ModelSchema, pool: BufferPool
    ) -> None:
        self._link = link
        self.rank = rank
        self.schema = schema
        self._pool = pool
        self._specs, self._model_len = foldmath.schema_specs(schema.tensors)
        self._held: memoryview | None = None  # the payload the last result's tensors view
        self._ahead: list[tuple[m.Consensus, memoryview | None]] = []

    @classmethod
    async def connect(cls, spec: RankSpec, rank: int, schema: ModelSchema, digest: str) -> DataLink:
        """Dial the relay's data socket, say hello, wait for the welcome (wrap in
        ``asyncio.timeout``).

        The welcome comes once the host's data connection to the controller is up; a relay or
        controller that refuses closes the link, raised here as :class:`ConnectionClosed`.
        """
        pool = BufferPool()
        credential = Credential.rank_from_hex(spec.credential_hex, round=spec.round, rank=rank)
        label = f"relay of {spec.host} (data)"
        try:
            link = await open_unix_framed(
                spec.data_socket,
                channel=Channel.DATA,
                credential=credential,
                peer_label=label,
                limits=HELLO_LIMITS,  # until the relay's welcome names the ceiling
                allocate=pool.acquire,
                plain_payloads=True,
            )
        # the relay is gone (its agent stopped) or never served data: say which socket, not an errno
        except OSError as exc:
            raise ConnectionClosed(
                f"rank {rank} cannot reach the data socket {spec.data_socket} of the relay of "
                f"{spec.host} ({exc.strerror or exc!r}); "
                "is the host's agent still running?",
                by_peer=True,
            ) from exc
        try:
            link.send(m.DataHello(rank=rank, model_bytes=schema.model_bytes, digest=digest))
            try:
                welcome = await link.recv_message()
            except ConnectionClosed as exc:
                raise ConnectionClosed(
                    f"the relay of {spec.host} closed rank {rank}'s data link during its hello (a "
                    "different model than the host's other ranks, "
                    "or the controller refused the host; the agent's and controller's logs say "
                    "which)",
                    by_peer=True,
                ) from exc
            if not isinstance(welcome, m.DataWelcome):
                raise ProtocolError(
                    f"rank {rank}: the relay answered DataHello with {type(welcome).__name__}, not "
                    "DataWelcome"
                )
            if welcome.max_payload < schema.model_bytes:
                raise ProtocolError(
                    f"rank {rank}: the relay's tensor ceiling {welcome.max_payload} is below the "
                    f"model's {schema.model_bytes} bytes"
                )
            assert link.codec is not None
            link.codec.limits = FrameLimits(max_payload=welcome.max_payload)
        except BaseException:
            link.abort()
            raise
        return cls(link, rank=rank, schema=schema, pool=pool)

    def _parts(self, tensors: Mapping[str, torch.Tensor]) -> list[memoryview]:
        parts: list[memoryview] = []
        for meta in self.schema.tensors:
            t = tensors.get(meta.name)
            if t is None:
                raise ValueError(
                    f"contribution of rank {self.rank} has no tensor {meta.name!r}; pass every "
                    "name of the model schema"
                )
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype != meta.dtype or tuple(t.shape) != meta.shape:
                raise ValueError(
                    f"contribution of rank {self.rank}: {meta.name!r} is {dtype} {tuple(t.shape)}, "
                    f"the schema says {meta.dtype} {meta.shape}"
                )
            parts.append(tensor_bytes(t.detach()))
        return parts

    async def send(
        self,
        round: int,
        kind: str,
        tensors: Mapping[str, torch.Tensor] | None,
        steps: int,
        weight: float,
        *,
        _borrow: bool = False,
    ) -> None:
        """Send this rank's contribution to ``round`` without waiting for the consensus (ASYNC
        submits).

        ``tensors=None`` is an empty contribution (weight 0). The tensors must be contiguous CPU
        tensors of the schema's dtypes and shapes; they are read until this returns.
        """
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
        if tensors is None:
            await self._link.send_tensors(
                m.Contribution(round=round, kind=kind, rank=self.rank, weight=0.0, steps=steps), []
            )
            return
        parts = self._parts(tensors)
        msg = m.Contribution(
            round=round,
            kind=kind,
            rank=self.rank,
            weight=float(weight),
            steps=steps,
            tensors=self._specs,
        )
        await self._link.send_tensors(msg, parts, borrow=_borrow)

    async def receive(self, round: int) -> ConsensusResult:
        """The consensus of ``round`` (earlier rounds' frames are skipped). Wrap in
        ``asyncio.timeout``."""
        self._release_held()
        while True:
            if self._ahead:
                msg, payload = self._ahead.pop(0)
            else:
                frame = await self._link.recv()
                if not isinstance(frame.message, m.Consensus):
                    self._pool.release(frame.payload)
                    raise ProtocolError(
                        f"rank {self.rank}: the relay sent {type(frame.message).__name__} on the "
                        "data link"
                    )
                msg, payload = frame.message, frame.payload
            if msg.round < round:
                self._pool.release(payload)  # a consensus that went by before this rank needed it
                continue
            if msg.round > round:
                self._ahead.append((msg, payload))
                raise ProtocolError(
                    f"rank {self.rank}: waiting for the consensus of round {round}, the relay sent "
                    f"round {msg.round}"
                )
            return self._result(msg, payload)

    def _result(self, msg: m.Consensus, payload: memoryview | None) -> ConsensusResult:
        if msg.mass == 0 or not msg.tensors:
            self._pool.release(payload)
            if msg.tensors or msg.mass != 0:
                raise ProtocolError(
                    f"rank {self.rank}: the consensus of round {msg.round} has mass {msg.mass} but "
                    f"{len(msg.tensors)} tensors"
                )
            return ConsensusResult(round=msg.round, kind=msg.kind, mass=0.0, tensors=None)
        payload_len = payload.nbytes if payload is not None else 0
        try:
            foldmath.check_specs(
                msg.tensors, self._specs, payload_len, what=f"the consensus of round {msg.round}"
            )
        except ProtocolError:
            self._pool.release(payload)
            raise
        assert payload is not None
        self._held = payload
        views = foldmath.views(msg.tensors, payload)
        named = {meta.name: v for meta, v in zip(self.schema.tensors, views, strict=True)}
        return ConsensusResult(round=msg.round, kind=msg.kind, mass=msg.mass, tensors=named)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        self._pool.release(held)  # dropped, not reused, while a caller still holds its tensors

    async def contribute(
        self,
        round: int,
        kind: str,
        tensors: Mapping[str, torch.Tensor] | None,
        steps: int,
        weight: float,
    ) -> ConsensusResult:
        """Send this rank's contribution to ``round`` and wait for its consensus (wrap in
        ``asyncio.timeout``).

        The tensors are written from their own memory (no copy): the consensus cannot come
        before the relay read all of them, and the caller holds them until this returns.
        """
        await self.send(round, kind, tensors, steps, weight, _borrow=True)
        return await self.receive(round)

    async def aclose(self) -> None:
        """Close the link (the relay drops this rank from its fold barrier)."""
        await self._link.aclose()
        self._release_held()
        for _msg, payload in self._ahead:
            self._pool.release(payload)
        self._ahead.clear()

    async def __aenter__(self) -> DataLink:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
