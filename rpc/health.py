"""gRPC health checking for every server of the system, keeping no state for names it
does not serve.

grpc_health's `HealthServicer` files every `Watch` under the service name the caller sent,
and leaves an entry per name behind when the stream ends: any caller could grow that map
without bound with made-up names. Here a Watch for a name that is not served is answered
SERVICE_UNKNOWN (the stream stays open, as the health protocol says) and nothing is kept
for it; a served name's watchers are forgotten, with their entry, when they end.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

SERVING = health_pb2.HealthCheckResponse.SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health.HealthServicer):
    """`grpc_health`'s servicer, bounded by the names `set` was called with."""

    def __init__(self, services: tuple[str, ...] = ("",)) -> None:
        """services: the names reported SERVING from the start ("" is the whole server)."""
        super().__init__()
        for service in services:
            self.set(service, SERVING)

    def Watch(self, request, context, send_response_callback=None):  # noqa: N802 - the API
        with self._lock:
            served = request.service in self._server_status
        if served:
            return super().Watch(request, context, send_response_callback)
        response = health_pb2.HealthCheckResponse(status=UNKNOWN)
        if send_response_callback is None:  # a server without non-blocking handlers
            return iter((response,))
        send_response_callback(response)
        return None

    def _on_close_callback(self, send_response_callback, service):
        def callback():
            with self._lock:
                watchers = self._send_response_callbacks.get(service, set())
                watchers.discard(send_response_callback)
                if not watchers:
                    self._send_response_callbacks.pop(service, None)
            send_response_callback(None)

        return callback

    def watched(self) -> int:
        """Names with watchers filed (at most the names served)."""
        with self._lock:
            return len(self._send_response_callbacks)
