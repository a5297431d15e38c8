"""Objects that hold the Redis password do not show it when printed or logged."""

from __future__ import annotations

from cluster.redis_server import RedisServer
from cluster.serve import ServeConfig

PASSWORD = "s3cret-Redis-pw"


def test_reprs_carry_no_redis_password(tmp_path):
    server = RedisServer(tmp_path, password=PASSWORD)
    config = ServeConfig(redis_url=server.url)
    for text in (repr(server), str(server), repr(config), str(config)):
        assert PASSWORD not in text
    assert PASSWORD in server.url  # what clients connect with still carries it
