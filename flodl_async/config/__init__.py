"""What a run is told: the cluster file, the command-line habits, the environment; frozen, pure.

The cluster file parsed into frozen specs with errors that point at the line, device specs,
ssh options, the placement plan, the ranks' command (torchrun's forms, and which python a
leading ``python`` is on each host), torchrun's stream routing (``--redirects``/``--tee``), the
process roles and rank environment contract (both ways), and argument habits the three commands
share.

Pure: nothing here imports asyncio or socket.
May import: errors, deadlines, host, control.
"""
