"""Which testbed failures are the machine's (skip) and which are faults (fail), decided
without building a testbed: the multihost tests skip on `TestbedUnsupported` alone."""

from __future__ import annotations

import subprocess

import pytest

from cluster import testbed
from cluster.testbed import TestbedUnavailable, TestbedUnsupported


def finished(returncode: int, stdout: str = "", stderr: str = ""):
    """What subprocess.run returns for any command: this exit status and output."""
    return lambda command, **_: subprocess.CompletedProcess(command, returncode, stdout, stderr)


@pytest.fixture
def root_with_tools(monkeypatch):
    """A root process on a machine with every tool, whose namespaces and apt-get work."""
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 0)
    monkeypatch.setattr(testbed.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(testbed.subprocess, "run", finished(0))
    monkeypatch.setattr(testbed, "PACKAGES", {"/nonexistent/sshd": "openssh-server"})


def fault(check) -> TestbedUnavailable:
    """The failure `check()` raises, asserted to be a fault, not the machine's limit."""
    with pytest.raises(TestbedUnavailable) as raised:
        check()
    assert not isinstance(raised.value, TestbedUnsupported), raised.value
    return raised.value


def test_a_machine_that_can_build_hosts_passes_the_check(root_with_tools):
    testbed.check_machine()


def test_without_root_the_machine_is_unsupported(root_with_tools, monkeypatch):
    monkeypatch.setattr(testbed.os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedUnsupported, match="not root"):
        testbed.check_machine()


def test_without_network_namespaces_the_machine_is_unsupported(root_with_tools, monkeypatch):
    monkeypatch.setattr(testbed.subprocess, "run", finished(1, stderr="Operation not permitted"))
    with pytest.raises(TestbedUnsupported, match="no network namespaces: Operation not permitted"):
        testbed.check_machine()


def test_a_missing_tool_is_a_fault(root_with_tools, monkeypatch):
    monkeypatch.setattr(testbed.shutil, "which", lambda tool: None if tool == "tc" else tool)
    assert "`tc` is not installed" in str(fault(testbed.check_machine))


def test_a_failed_apt_get_is_a_fault(root_with_tools, monkeypatch):
    monkeypatch.setattr(testbed.subprocess, "run", finished(100, stderr="E: Unable to locate"))
    assert "`apt-get update -qq` failed: E: Unable to locate" in str(
        fault(testbed.install_packages)
    )


def test_packages_missing_without_apt_get_are_a_fault(root_with_tools, monkeypatch):
    monkeypatch.setattr(testbed.shutil, "which", lambda tool: None)
    assert "no apt-get" in str(fault(testbed.install_packages))


def test_no_free_subnet_is_a_fault(monkeypatch):
    used = "".join(f"inet 10.213.{i}.1/24\n" for i in range(1, 255))
    monkeypatch.setattr(testbed.subprocess, "run", finished(0, stdout=used))
    assert "no free /24" in str(fault(testbed.free_subnet))
