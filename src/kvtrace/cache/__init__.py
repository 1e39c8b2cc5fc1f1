"""Cache kinds: what a cache layer of each ``LayerKind`` holds and how it is read and written.

``hf`` maps transformers' cache objects (DynamicCache, StaticCache, EncoderDecoderCache) to and from
the CacheSpec's tensors.

May import: ``spec``.
"""
