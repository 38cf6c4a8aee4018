"""The user's Trainer in each of its roles.

``api`` (``Trainer``, ``TrainingRun``; ``checks`` validates its arguments) picks a driver for
the process it runs in; ``entry`` says which role that is; ``inline``, ``rank`` and ``launcher``
are the drivers (one process, a rank of a run, the process that launches and coordinates one);
``schedule`` is the rank's and the inline run's schedule side by side; ``worker`` the compute
side; ``state`` what a finished run hands back; ``rankstate`` and ``inlinesave`` a rank's and an
inline run's part of a checkpoint. The drivers never import ``api``.

May import: verdict, errors, wire, deadlines, host, training, checkpoint, net, config, relay,
agent, controller, cli.
"""
