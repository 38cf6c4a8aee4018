"""The operator's and the launcher's commands.

``launch`` is ``flodl-launch`` (a run from a cluster file or flags, with its verdict; its
options, torchrun's spellings among them, are ``launchargs``), ``flodl``
is ``flodl`` (status, ps, token), ``statusclient`` is ``flodl status``'s blocking client, and
``verdictline`` says how a run's verdict line reads (done, stopped or FAILED).

May import: _version, verdict, errors, wire, status, deadlines, host, net, config, agent,
controller.
"""
