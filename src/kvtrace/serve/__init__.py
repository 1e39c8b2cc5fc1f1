"""Serve: an OpenAI-compatible HTTP server over an artifact's conversation slots (``kvtrace serve``).

``worker`` (the model thread: owns the ``SlotEngine`` and its programs, admits queued requests into free
slots and decodes every active slot per step — continuous batching; HTTP handlers talk to it through
thread-safe queues only), ``protocol`` (the OpenAI request bodies checked into ``SlotRequest`` s, the
response and SSE chunk shapes, errors in OpenAI's shape), ``metrics`` (Prometheus text: requests, tokens,
queue depth, latency histograms), ``app`` (the Starlette routes and ``serve``, run by uvicorn). Starlette
and uvicorn are the optional extra ``kvtrace[serve]``, imported only here.

May import: ``spec`` … ``tools``.
"""
