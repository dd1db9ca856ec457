"""The serving layer: what drives an engine. The drive loop (`drive`, `Timing`) that
`generate()`, `kernelgate run` and the warm-up share; the warm-up; the loop that owns an engine
under a server (core_loop, in a thread or a process of its own: core_process) and its messages;
the asyncio front end (`AsyncEngine`)."""
