"""`vericache serve` as a user runs it: embedded Redis and Ray, endpoints printed, Ctrl-C
shuts everything down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from cluster.cli import main
from decoder.service import DecoderClient
from prefix_store.client import StoreClient

pytestmark = pytest.mark.cluster


def test_serve_embedded_prints_endpoints_and_stops_cleanly_on_ctrl_c(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERICACHE_HOME", str(tmp_path))
    command = [
        sys.executable,
        "-m",
        "cluster.cli",
        "serve",
        "--shards",
        "1",
        "--memory-bytes",
        "64MiB",
        "--disk-bytes",
        "0",
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, VERICACHE_HOME=str(tmp_path)),
    )
    try:
        lines, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, f"serve exited early: {''.join(lines)}"
            lines.append(line)
            if "Ctrl-C" in line:
                break
        endpoint = next(x.split()[1] for x in lines if x.strip().startswith("store"))
        decoder = next(x.split()[1] for x in lines if x.strip().startswith("decoder"))
        assert (tmp_path / "cluster.json").exists()
        metrics = [x.split()[1] for x in lines if x.strip().startswith("metrics")]
        assert len(metrics) == 3  # the shard's, the decoder's and the router's
        with pytest.raises(urllib.error.HTTPError) as refused:  # no token
            urllib.request.urlopen(metrics[0], timeout=5)
        assert refused.value.code == 401
        capsys.readouterr()
        assert main(["tenant", "add", "alice"]) == 0
        token = capsys.readouterr().out.strip()
        with StoreClient(endpoint, token) as client:
            assert client.topology.tenant == "alice" and len(client.topology.shards) == 1
        with DecoderClient(decoder, token) as client:
            info = client.info()
            assert info.worker_id == "decoder-0" and info.in_flight == 0
        router = next(x.split()[1] for x in lines if x.strip().startswith("router"))
        with DecoderClient(router, token) as client:
            assert client.info().worker_id == "router-0"
        capsys.readouterr()
        assert main(["status"]) == 0
        live = capsys.readouterr().out.split("live (from the metrics endpoints):")[1]
        assert "decoder-0" in live and "shard-0" in live and "tok/s" in live
        assert "unreachable" not in live
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 0
        assert "shutting down" in process.stdout.read()
        assert not (tmp_path / "cluster.json").exists()
    finally:
        if process.poll() is None:
            process.kill()
