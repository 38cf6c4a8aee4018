"""The controller: the asyncio shell that binds the one port and carries out the supervisor's
decisions.

``shell`` pumps events from the port's channels and the agent launchers into the
pure :class:`~flodl_async.control.supervisor.Supervisor` and performs the actions it
returns; ``launchers`` is the seam through which agents come to exist on their
hosts (in-process today; over ssh and by dial-in next).
"""

from ..config.plan import LaunchPlan, PlacedWorker, Placement
from ..verdict import ExitCode, RunResult
from .shell import Controller

__all__ = ["Controller", "ExitCode", "LaunchPlan", "PlacedWorker", "Placement", "RunResult"]
