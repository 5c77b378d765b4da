"""The worker's radix KV cache (SGLang RadixAttention behaviour) and its slot allocator.

Pure Python + numpy: no asyncio, grpc, torch or clock imports.
"""
