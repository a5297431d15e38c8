"""The router: one front door to a deployment's decoders (docs/DESIGN.md section 7).

It serves the same `Decoder` gRPC service as a decoder, so every client works against it
unchanged; it sends each request to a decoder its routing policy chooses (`policies`: by
default prefix affinity with bounded load, over the request's prefix `identity`), among
the live decoders and their loads as their Info reports them (`members`), and continues a
stream on another decoder when its decoder fails mid-stream, so that the caller sees one
uninterrupted stream identical to full-KV decoding (`relay`).
"""

from decoder.router.config import RouterConfig
from decoder.router.server import RouterServer

__all__ = ["RouterConfig", "RouterServer"]
