"""The server toolkit every gRPC server of the system is built with (shards, decoders,
routers), so that each lets calls in, bounds them, counts them and ends their failures the
same way:

- `handler`: the auth-first handler (`unary`, `streaming`) each service drives with its
  `Gate` (authenticate from the metadata alone, take a call slot, read the request, serve);
- `limits`: call slots by fair share with an admin pool, a tenant's stream slots (Attend), idle
  client streams cut;
- `status`: typed errors to status codes (`StatusMap`: a tier's table over the one below)
  and the one abort that ends a failed call;
- `metrics`: every call counted by method and final status (`RpcMetrics`);
- `server`: the server builder with health checking, reflection and TLS, and the request
  helpers handlers share (parsing with a precise INVALID_ARGUMENT, the caller's address);
- `health`: health checking bounded by the names served.

It stands beside the store's ground floor (it uses the store's TLS, typed errors and status
table); the client SDKs never import it (`make lint` checks the layers)."""
