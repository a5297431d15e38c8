"""The server toolkit every gRPC server of the system is built with (shards, decoders,
routers): the server builder with health checking and reflection (`server`), bounded
health checking (`health`), and the request helpers their handlers share (parsing with a
precise INVALID_ARGUMENT, the caller's address as the data plane sees it).

It stands beside the store's ground floor (it uses the store's TLS and typed errors);
the client SDKs never import it (`make lint` checks the layers)."""
