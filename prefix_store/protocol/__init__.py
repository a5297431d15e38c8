"""What both ends of the store's wire share, and nothing else: the data plane's frames
(`frames`), the hand-rolled bulk protobuf codec (`wire`), token ids (`tokens`) and the
Attend RPC's bounds (`attend`). The client SDK and the shard import it; it imports neither
(`make lint` checks the layers)."""
