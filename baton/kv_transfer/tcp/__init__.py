"""The TCP transport for paged KV blocks: a block server on the prefill side (``server.py``), a
reader on the decode side (``reader.py``), the wire format between them (``wire.py``), and the
``KVTransport`` the connector uses (``transport.py``).

The KV cache is one contiguous tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads,
head_dim]``, so one block of all layers is one contiguous byte region and a run of consecutive block
ids is one larger region. Bytes go from the server's tensor memory to the socket (``sendall`` of a
memoryview per run) and from the socket into the reader's tensor memory (``recv_into`` per run) with
no intermediate buffer. A cache in device memory (or any, with ``--kv-staging always``) goes
through host staging buffers instead, chunk by chunk (``staging.py``). ``bench/kv_transfer.py``
prints the transport's rate against a raw socket.
"""
