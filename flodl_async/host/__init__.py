"""This machine and this process: what they have and what they may do.

GPUs and cores, addresses, hostnames and interfaces, process trees and the sockets they hold
(``/proc``), the owner of a local TCP socket (``sock_diag``), the private
runtime directory and the registry of runs in it, secret and token files, systemd's notify
socket, and the console writer. Every question of the kind "how many GPUs", "which interface",
"where is the runtime directory" has its one answer here, for the controller, the agent and the
Trainer alike.

May import: verdict, errors, wire.
"""
