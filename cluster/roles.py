"""The Ray custom resources that give hosts their role (imported without Ray)."""

STORAGE_RESOURCE = "storage"
"""Advertised by storage hosts (`vericache node start --storage`); shards go only there."""
DECODER_RESOURCE = "decoder"
"""Advertised by decoder hosts (`vericache node start --decoder`); where there are any,
decoders go only there."""
