"""KV compressors behind one interface (DESIGN.md section 6), one module per method.

`parse_compressor(spec)` is the only way in: it returns a pipeline that compresses a
prefix's full KV layer by layer into a `CompressedKV` the drafter attends over.
"""

from decoder.compressors.base import CompressedKV, CompressedLayer, Compressor, DenseLayer
from decoder.compressors.registry import (
    REGISTRY,
    CompressorPipeline,
    describe_compressors,
    parse_compressor,
)

__all__ = [
    "REGISTRY",
    "CompressedKV",
    "CompressedLayer",
    "Compressor",
    "CompressorPipeline",
    "DenseLayer",
    "describe_compressors",
    "parse_compressor",
]
