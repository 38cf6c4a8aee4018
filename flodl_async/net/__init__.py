"""The asyncio shell around the wire: the only code in flodl_async that opens a socket.

The one port's mux (sniffing channel magics and routing), admission of new connections, framed
links over the sans-IO codec, the status HTTP endpoints, the rendezvous store served on the port
(and torch's TCPStore on a pre-bound socket), buffer pools, descriptor limits and the event
loop factory (uvloop when present), and the one "first signal graceful, second forces" helper.

May import: _version, verdict, errors, wire, status, deadlines, host.
"""
