"""The asyncio shell: the only code in flodl_async that touches sockets."""
