"""The per-host relay and both ends of its unix-socket protocol.

A host's ranks reach the controller through its relay: ``control`` (the relay itself: the rank
control links and the upstream link), ``fold`` (the host fold of the ranks' contributions before
one frame goes up), ``upstream`` (the host's data connection it goes up on), and the rank's
ends, ``ranklink`` (its control link) and ``datalink`` (its data link). One package holds both
sides of the relay-rank contract.

May import: errors, wire, deadlines, host, control, training, net, config.
"""
