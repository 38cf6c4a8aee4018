"""The controller process's asyncio shell and its services.

``shell`` binds the one port, pumps events from its channels and the agent launchers into the
pure supervisor and carries out the actions it returns; ``launchers`` and ``fanout`` bring agents
to their hosts (in process, over ssh); ``training`` and ``reducer`` are the Trainer's side of the
controller (the coordinator's shell and the data channel's reduction); ``bundles`` and ``resumes``
write the run's checkpoint bundles and verify the one it resumes from.

May import: _version, verdict, errors, wire, status, deadlines, host, control, training,
checkpoint, net, config, relay, agent.
"""

from ..config.plan import LaunchPlan, PlacedWorker, Placement
from ..verdict import ExitCode, RunResult
from .shell import Controller

__all__ = ["Controller", "ExitCode", "LaunchPlan", "PlacedWorker", "Placement", "RunResult"]
