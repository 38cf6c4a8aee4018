"""The run's pure decision cores: ``handle(event, now) -> actions``, none of them able to await.

The supervisor (the run from join window to verdict; ``exits`` says how a rank's exit reads in it),
membership (the join window), liveness and backoff, the relay control links, the supervisor's watch
on its hosts' links, the vocabulary both cores speak (ticks, levels, what to tell and say) and the
type tables the cores and shells dispatch through. The asyncio shells in ``controller/`` and
``agent/`` feed them events and carry out their actions; a unit test drives them on a fake clock.

Pure: nothing here imports asyncio or socket.
May import: _version, verdict, errors, wire, status, host.
"""
