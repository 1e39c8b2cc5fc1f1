"""Serve: an OpenAI-compatible HTTP server over an artifact's conversation slots (``kvtrace serve``).

``worker`` (the model thread: owns the ``SlotEngine`` and its programs, admits queued requests into free
slots and decodes every active slot per step — continuous batching; HTTP handlers talk to it through
thread-safe queues only), ``protocol`` (the OpenAI request bodies checked into ``SlotRequest`` s, the
response and SSE chunk shapes, errors in OpenAI's shape; ``response_format`` and ``logit_bias``), ``tools``
(``tools`` / ``tool_choice`` for any model: answers held to one tool-call JSON and read back into
``tool_calls``), ``metrics`` (Prometheus text: requests, tokens,
queue depth, latency histograms), ``app`` (the Starlette routes and ``serve``, run by uvicorn). Starlette
and uvicorn are the optional extra ``kvtrace[serve]``, imported only here.

May import: ``spec`` … ``tools``.
"""

__all__ = ["GGUF_SERVE_BACKEND", "SERVE_BACKEND"]

# The backend a model source is served from (``kvtrace serve SOURCE``, ``kvtrace bench --serve``): aoti-packed,
# one frozen program whose CPU matmuls stay cheap from 1 to N rows. SmolLM2 fp32 on AMD, 2 threads (kvtrace
# bench --serve, one run): one client 24.3 tokens/s and eight 99.9 aggregate, vs aoti's MKL matmuls at 10 tokens/s
# for one (a step of two rows cost as much as two steps of one there); on Intel its frozen matmuls decode faster
# than aoti too.
SERVE_BACKEND = "aoti-packed"

# ... and with GGUF blocks kept (``--quant gguf``): aoti, whose decode program of its own (T = 1) runs each row
# through GGUFLinear's one-token path; aoti-packed's one T-symbolic program would dequantize every weight each
# step. SmolLM2 Q4_1, 4 slots, 2 threads (stop 50): a decode step of 1 / 4 rows 11.5-15.4 / 25.8-27.7 ms.
GGUF_SERVE_BACKEND = "aoti"
