"""The top floor: the `vericache` CLI, Ray deployment and cluster configs."""
