"""The NIXL transport for paged KV blocks: the decode side READs leased blocks straight out of the
prefill engine's registered KV tensor (UCX backend: shared memory between processes on one host,
TCP or RDMA across hosts, GPU memory where the tensor is on CUDA).

Each engine registers its whole KV tensor ``[num_blocks, ...]`` with one NIXL agent once and runs a
small side channel, a TCP socket on ``config.host:config.port``; its port is the ``remote_port``
readers are given. Messages are length-prefixed msgpack structs (``channel.py``). A read:

    reader -> server  Hello (first contact with an address): the server's engine id, its agent
                      metadata and its tensor's base address, number of blocks and block bytes;
                      the reader adds the remote agent and caches it per (host, port, engine id)
    reader -> server  Lookup: engine id, request id, block ids, block bytes and how long the read
                      may take; the server checks the lease like the TCP transport and answers the
                      per-block checksums it computed when the lease was made
    reader            NIXL READs of the coalesced regions into its own blocks, 16 MiB at a time,
                      polled until done or the deadline; each chunk's blocks are checksummed on a
                      second thread while the next chunk is READ, and compared with the server's
    reader -> server  Done (one way): the server drops the lease and reports it claimed

DONE and release travel on the side channel rather than as NIXL notifications: a release needs
no NIXL connection at all (a decode engine may release a lease of an engine it never read from),
the server gets it from the socket thread it already has instead of polling the agent from the
engine's busy loop, and a release is answered, so its failure is visible like TCP's.

A Lookup holds the lease against expiry (``leases.py``). The agent runs without NIXL's progress
thread, which spins a core at 100% even when idle; readers drive their own transfers by polling,
and the server polls its agent only while a hold is active, which transports without one-sided
hardware support (UCX over TCP) need to make progress (``server.py``).

Only ``transport.py`` needs a NIXL package (``nixl``, ``nixl-cu12``, ``nixl-cu13``): importing it
raises ImportError when none imports, which ``choose_transport`` (``connector.py``) reads as
"NIXL unavailable". The side channel and the serving side import without one.
"""
