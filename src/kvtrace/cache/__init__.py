"""Cache kinds: what a cache layer of each ``LayerKind`` holds and how it is read and written.

``kinds`` (the ``KindOps`` protocol and the lookup ``ops(kind)`` / ``kind_of(layer_spec)``), one module per
kind: ``full`` (self-attention, one slot per position), ``cross`` (cross-attention to N image tokens,
filled once by the image prefill, and the ``cross.mask``/``cross.active`` state its layers share),
``sliding`` (a ring of ``window`` slots, position p in slot p % window, and the mask its attention uses). Each
says its buffers, how a program writes it, which slots are valid at a position, whether rewind is defined,
whether decode writes it, and how a transformers cache layer of that kind maps to it (a sliding layer:
HF's ``DynamicSlidingWindowLayer``, held by ``kvtrace.jit`` as its stored tail). ``int8``: the int8 K/V
option on any self-attention kind (``CacheSpec.kv_dtype``): quantize/dequantize with per-token, per-head
float16 scales, and the read/write/valid a decoder and verify use, writing through the kind's own ``write``. ``hf`` maps
transformers' cache objects (DynamicCache, StaticCache, EncoderDecoderCache) to and from flat tensors,
asking the kinds about each layer. Adding a kind: a module defining ``OPS`` and one line in
``kinds._MODULES``.

May import: ``spec``.
"""
