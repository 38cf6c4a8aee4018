"""The operator's and the launcher's commands.

``launch`` is ``flodl-launch`` (a run from a cluster file or flags, with its verdict), ``flodl``
is ``flodl`` (status, ps, token), and ``statusclient`` is ``flodl status``'s blocking client.

May import: _version, verdict, errors, wire, status, deadlines, host, net, config, agent,
controller.
"""
