"""Several real hosts on one machine, for the multi-host tests and `make bench-cluster`.

Each host is a network namespace with its own address on a bridge (veth pair), its own
mount namespace with a private `/tmp`, `/dev/shm` and home directory, and an SSH server
(Debian's `openssh-server`) that accepts one throwaway key. Whatever a host runs over SSH
(Ray, Redis, the service) sees only that host's network and files, like a separate
machine sharing this machine's read-only software. The machine itself reaches the hosts
through the bridge's address, as an operator's laptop would.

Needs root. `Testbed.close()` kills every process of every host and removes the
namespaces, the bridge and the files, including after a failure.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

PACKAGES = {"/usr/sbin/sshd": "openssh-server", "/usr/bin/rsync": "rsync"}
"""What the hosts need that a bare machine may lack (Ray's `ray up` uses ssh and rsync)."""

SSH_OPTIONS = (
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "IdentitiesOnly=yes",
    "-o", "LogLevel=ERROR",
    "-o", "ConnectTimeout=10",
)  # fmt: skip


class TestbedUnavailable(RuntimeError):
    """Hosts could not be built here: a setup step failed (a tool missing, packages that did
    not install, no free subnet). A fault to fix, unlike its subclass `TestbedUnsupported`."""

    __test__ = False


class TestbedUnsupported(TestbedUnavailable):
    """This machine cannot build hosts at all: the process is not root, or it cannot create
    network namespaces (an unprivileged container). The only reason to skip the hosts."""

    __test__ = False


@dataclass(frozen=True, slots=True)
class TestbedConfig:
    """The hosts to build."""

    __test__ = False  # not a pytest class

    hosts: tuple[str, ...] = ("head", "storage1", "storage2", "decoder1")
    """Host names, in address order (.10, .11, ...)."""
    subnet: str | None = None
    """A free /24 such as 10.213.7.0/24; None picks an unused one under 10.213.0.0/16."""
    root: Path = Path("/var/tmp")
    """Where the per-host directories go (not under /tmp: each host gets its own /tmp)."""
    carry: tuple[Path, ...] = ()
    """Paths the hosts must see although they lie under /tmp or the home directory (the
    project checkout, the model cache; the running Python's installation always is);
    everything else is shared as it is."""
    shm_bytes: int = 2 << 30
    """Size of each host's private /dev/shm (Ray's object store lives there)."""

    def __post_init__(self) -> None:
        if not self.hosts or len(set(self.hosts)) != len(self.hosts):
            raise ValueError("hosts: give at least one, without repeats")
        if len(self.hosts) > 40:
            raise ValueError("hosts: at most 40")


@dataclass
class Host:
    """One host: its namespaces, address and SSH server."""

    name: str
    netns: str
    address: str
    veth: str
    """Its interface (inside the namespace), named eth0 there."""
    peer: str
    """The bridge side of its veth pair."""
    directory: Path
    key: Path
    sshd: subprocess.Popen | None = None

    def ssh(
        self, command: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess:
        """Run `command` on the host through SSH in a login shell, as an operator would."""
        argv = ["ssh", "-i", str(self.key), *SSH_OPTIONS, f"root@{self.address}"]
        argv.append("bash -lc " + shlex.quote(command))
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, command, result.stdout, result.stderr
            )
        return result

    def link(self, up: bool) -> None:
        """Take the host's network link down (packets are dropped, nothing is reset) or up."""
        _run(["ip", "-n", self.netns, "link", "set", "eth0", "up" if up else "down"])

    def shape(self, rate_bytes_per_s: float | None) -> None:
        """Limit the host's link to `rate_bytes_per_s` in both directions with a
        token-bucket filter (`tc ... tbf`); None removes the limit."""
        shape_link(["ip", "netns", "exec", self.netns], "eth0", self.peer, rate_bytes_per_s)


def shape_link(inside: list[str], device: str, peer: str, rate: float | None) -> None:
    """tbf on both ends of a veth pair: `device` (run through `inside`) and `peer` (here)."""
    for prefix, name in ((inside, device), ([], peer)):
        with contextlib.suppress(subprocess.CalledProcessError):
            _run([*prefix, "tc", "qdisc", "del", "dev", name, "root"], quiet=True)
        if rate is not None:
            _run([*prefix, "tc", "qdisc", "add", "dev", name, "root", *tbf(rate)])


def tbf(rate_bytes_per_s: float) -> list[str]:
    """tbf arguments for a rate: a bucket of 4 ms at that rate (at least 64 KiB, so a
    full-size GSO segment fits) and up to 20 ms of queue."""
    burst = max(64 << 10, int(rate_bytes_per_s * 0.004))
    return ["tbf", "rate", f"{int(rate_bytes_per_s * 8)}bit", "burst", str(burst),
            "latency", "20ms"]  # fmt: skip


class Testbed:
    """Builds the hosts of `config`; a context manager that always tears them down."""

    __test__ = False  # not a pytest class

    def __init__(self, config: TestbedConfig | None = None) -> None:
        self.config = config or TestbedConfig()
        self.tag = f"vc{os.getpid() % 100000}"
        self.bridge = f"{self.tag}br"
        self.hosts: dict[str, Host] = {}
        self.directory: Path | None = None
        self.gateway = ""
        """This machine's address on the hosts' network (its own link, `uplink`)."""
        self.uplink = (f"{self.tag}gw", f"{self.tag}gwp")
        """This machine's veth pair to the bridge: (its end, the bridge's end)."""
        self._built_bridge = False

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> Testbed:
        check_machine()
        sweep(self.config.root)
        network = ipaddress.ip_network(self.config.subnet or free_subnet())
        self.gateway = str(network.network_address + 1)
        self.directory = Path(
            tempfile.mkdtemp(prefix=f"vericache-testbed-{self.tag}-", dir=self.config.root)
        )
        self.directory.chmod(0o755)
        key = self._keys()
        self._bridge(network)
        for index, name in enumerate(self.config.hosts):
            host = self._host(name, index, str(network.network_address + 10 + index), key)
            self.hosts[name] = host
        for host in self.hosts.values():
            wait_for_ssh(host)
        return self

    def close(self) -> None:
        for host in self.hosts.values():
            kill_all(host.netns)
            if host.sshd is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.sshd.wait(5)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.peer], capture_output=True)
        self.hosts.clear()
        if self._built_bridge:
            subprocess.run(["ip", "link", "del", self.uplink[0]], capture_output=True)
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self._built_bridge = False
        if self.directory is not None and not mounted_under(self.directory):
            shutil.rmtree(self.directory, ignore_errors=True)
        self.directory = None

    # ---- building ------------------------------------------------------------------------

    def _keys(self) -> Path:
        """A throwaway host key and client key; the client key is the only one accepted."""
        keys = self.directory / "keys"
        keys.mkdir()
        for name in ("host_key", "client_key"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self.tag,
                  "-f", str(keys / name)])  # fmt: skip
        shutil.copy(keys / "client_key.pub", keys / "authorized_keys")
        return keys / "client_key"

    def _bridge(self, network) -> None:
        """The hosts' switch, and this machine's own link to it (a veth pair, like the
        hosts', so that its traffic can be shaped too)."""
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._built_bridge = True
        _run(["ip", "link", "set", self.bridge, "up"])
        end, port = self.uplink
        _run(["ip", "link", "add", end, "type", "veth", "peer", "name", port])
        _run(["ip", "link", "set", port, "master", self.bridge, "up"])
        _run(["ip", "addr", "add", f"{self.gateway}/{network.prefixlen}", "dev", end])
        _run(["ip", "link", "set", end, "up"])

    def shape(self, rate_bytes_per_s: float | None) -> None:
        """Limit this machine's own link to the hosts (everything a process here sends to
        or receives from them) in both directions; None removes the limit."""
        end, port = self.uplink
        shape_link([], end, port, rate_bytes_per_s)

    def _host(self, name: str, index: int, address: str, key: Path) -> Host:
        netns, peer = f"{self.tag}-{name}", f"{self.tag}h{index}"
        host = Host(name, netns, address, f"{self.tag}e{index}", peer,
                    self.directory / name, key)  # fmt: skip
        prefix = ipaddress.ip_network(f"{self.gateway}/24", strict=False).prefixlen
        _run(["ip", "netns", "add", netns])
        _run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", peer, "master", self.bridge, "up"])
        _run(["ip", "link", "set", host.veth, "netns", netns])
        inside = ["ip", "-n", netns]
        _run([*inside, "link", "set", host.veth, "name", "eth0"])
        _run([*inside, "addr", "add", f"{address}/{prefix}", "dev", "eth0"])
        _run([*inside, "link", "set", "eth0", "up"])
        _run([*inside, "link", "set", "lo", "up"])
        _run([*inside, "route", "add", "default", "via", self.gateway])
        host.sshd = self._start_sshd(host)
        return host

    def _start_sshd(self, host: Host) -> subprocess.Popen:
        """sshd as PID 1 of the host: in its network namespace, and in fresh mount, PID, UTS
        and IPC namespaces where /tmp, /dev/shm, the home directory, the process table and
        the host name are its own (`ray stop` on one host must not see another's Ray)."""
        home, tmp = host.directory / "home", host.directory / "tmp"
        for path in (home, tmp):
            path.mkdir(parents=True)
        tmp.chmod(0o1777)
        (home / ".bashrc").write_text(f"# {host.name} (vericache testbed)\n")
        config = host.directory / "sshd_config"
        config.write_text(sshd_config(host, self.directory / "keys"))
        Path("/run/sshd").mkdir(exist_ok=True)
        script = "set -e\n" + "".join(
            f"mkdir -p {shlex.quote(str(target))} && mount --bind {shlex.quote(str(path))} "
            f"{shlex.quote(str(target))}\n"
            for path, target in carried((*self.config.carry, Path(sys.base_prefix)), tmp, home)
        )
        script += (
            f"hostname {shlex.quote(host.name)}\n"
            f"mount --rbind {tmp} /tmp\n"
            f"mount --rbind {home} {shlex.quote(str(Path.home()))}\n"
            f"mount -t tmpfs -o size={self.config.shm_bytes} tmpfs /dev/shm\n"
            f"exec /usr/sbin/sshd -D -e -f {config}\n"
        )
        log = (host.directory / "sshd.log").open("wb")
        return subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--mount", "--propagation",
             "private", "--pid", "--fork", "--mount-proc", "--uts", "--ipc", "--",
             "sh", "-c", script],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def sshd_config(host: Host, keys: Path) -> str:
    return "\n".join(
        [
            f"ListenAddress {host.address}",
            "Port 22",
            f"HostKey {keys / 'host_key'}",
            f"AuthorizedKeysFile {keys / 'authorized_keys'}",
            f"PidFile {host.directory / 'sshd.pid'}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PrintMotd no",
            "MaxStartups 64:30:128",
            "MaxSessions 64",
            "Subsystem sftp internal-sftp",
            "",
        ]
    )


def carried(paths, tmp: Path, home: Path) -> list[tuple[Path, Path]]:
    """(path, where it must appear inside the host's own /tmp or home) for each carried
    path that those would otherwise hide."""
    out = []
    for path in (Path(p).resolve() for p in paths):
        for hidden, own in ((Path("/tmp"), tmp), (Path.home(), home)):
            if path.is_relative_to(hidden):
                out.append((path, own / path.relative_to(hidden)))
    return out


# ---- the machine ------------------------------------------------------------------------


def check_machine() -> None:
    """Raise, with the reason, when hosts cannot be built here: TestbedUnsupported when the
    machine cannot (not root, no network namespaces), TestbedUnavailable when a tool is
    missing or the packages do not install."""
    if os.geteuid() != 0:
        raise TestbedUnsupported("not root (hosts need network and mount namespaces)")
    for tool in ("ip", "tc", "unshare", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            raise TestbedUnavailable(f"`{tool}` is not installed")
    probe = f"vcprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        raise TestbedUnsupported(f"no network namespaces: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    install_packages()


def install_packages(timeout_s: float = 900) -> None:
    """Install openssh-server and rsync with apt-get when they are missing."""
    missing = sorted({pkg for path, pkg in PACKAGES.items() if not Path(path).exists()})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise TestbedUnavailable(f"{', '.join(missing)} missing and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    steps = (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
    )
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env=env, timeout=timeout_s)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise TestbedUnavailable(f"`{' '.join(step)}` failed: {' '.join(tail)}")


def free_subnet() -> str:
    """A /24 under 10.213.0.0/16 that no interface of this machine uses."""
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    for third in range(1, 255):
        if f"10.213.{third}." not in used:
            return f"10.213.{third}.0/24"
    raise TestbedUnavailable("no free /24 under 10.213.0.0/16")


def wait_for_ssh(host: Host, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if host.sshd.poll() is not None:
            log = (host.directory / "sshd.log").read_text(errors="replace").strip()
            raise RuntimeError(f"sshd of {host.name} exited: {log[-500:]}")
        result = host.ssh("true", timeout=15, check=False)
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{host.name}: no ssh within {timeout_s} s: {result.stderr}")
        time.sleep(0.2)


def kill_all(netns: str) -> None:
    """SIGKILL every process in a network namespace (a host's sshd, sessions, Ray)."""
    for _ in range(5):
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
        if not out.stdout.split():
            return
        for pid in map(int, out.stdout.split()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def sweep(root: Path) -> None:
    """Remove what testbeds of processes that no longer exist left behind (a run that was
    killed before it could clean up): their namespaces' processes, links and files."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in names.splitlines():
        ns = line.split()[0] if line.split() else ""
        tag = ns.split("-")[0]
        if not (tag.startswith("vc") and tag[2:].isdigit()) or _alive(int(tag[2:])):
            continue
        kill_all(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{tag}gw"], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{tag}br"], capture_output=True)
    for directory in root.glob("vericache-testbed-vc*-*"):
        tag = directory.name.split("-")[2]
        if tag[2:].isdigit() and not _alive(int(tag[2:])) and not mounted_under(directory):
            shutil.rmtree(directory, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether a testbed's creating process (pid modulo 100000) may still be running."""
    return any(int(p) % 100000 == pid for p in os.listdir("/proc") if p.isdigit())


def mounted_under(directory: Path) -> bool:
    """Whether anything is mounted below `directory` in this mount namespace (then it is
    not removed: a bind of the project must never be deleted through it)."""
    root = str(directory.resolve())
    with open("/proc/self/mountinfo") as mounts:
        return any(line.split()[4].startswith(root) for line in mounts)


def _run(argv: list[str], quiet: bool = False) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        if quiet:
            raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


# ---- Ray clusters on the hosts ----------------------------------------------------------


AUTOSCALER_LOG = "/tmp/ray/session_latest/logs/monitor.log"
"""Where the head's autoscaler (which starts the worker hosts) logs, on the head host."""


class LocalCluster:
    """`ray up` of cluster/local.yaml onto testbed hosts, as an operator runs it.

    The hosts share this machine's disk, so the rendered config points them at `checkout`
    (installed already: its `make install` setup command is a no-op) instead of syncing a
    copy; every other command of the config runs as written, with the hosts' addresses
    (and `partition_s`, where given, as every node's `--partition-s`)."""

    def __init__(
        self,
        bed: Testbed,
        checkout: Path,
        head: str,
        storage: Sequence[str],
        decoder: Sequence[str] = (),
        object_store_bytes: int = 200_000_000,
        partition_s: float | None = None,
    ) -> None:
        self.bed, self.checkout = bed, Path(checkout)
        self.partition_s = partition_s
        self.head, self.workers = head, [*storage, *decoder]
        self.storage, self.decoder = list(storage), list(decoder)
        self.object_store_bytes = object_store_bytes
        self.config = bed.directory / "cluster.yaml"
        self.ray = str(Path(sys.executable).parent / "ray")

    def render(self) -> Path:
        config = yaml.safe_load((self.checkout / "cluster/local.yaml").read_text())
        address = {name: host.address for name, host in self.bed.hosts.items()}
        config["cluster_name"] = self.bed.tag
        config["provider"].update(
            head_ip=address[self.head], worker_ips=[address[w] for w in self.workers]
        )
        key = str(self.bed.hosts[self.head].key)
        config["auth"] = {"ssh_user": "root", "ssh_private_key": key}
        config["file_mounts"] = {}
        roles = {
            r"--ip \S+": f"--ip {address[self.head]}",
            r"--storage \S+": "--storage " + ",".join(address[s] for s in self.storage),
            r" --decoder \S+": (" --decoder " + ",".join(address[d] for d in self.decoder))
            if self.decoder
            else "",
            r"vericache node start": "vericache node start --object-store-bytes "
            f"{self.object_store_bytes}"
            + (f" --partition-s {self.partition_s:g}" if self.partition_s else ""),
            r"~/vericache|\$HOME/vericache": str(self.checkout),
        }
        for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
            commands = []
            for command in config[key]:
                for pattern, new in roles.items():
                    command = re.sub(pattern, new.replace("\\", "\\\\"), command)
                commands.append(command)
            config[key] = commands
        workers = " ".join(config["worker_start_ray_commands"])
        if f"--storage {','.join(address[s] for s in self.storage)}" not in workers:
            raise ValueError("cluster/local.yaml: no `--storage` list to fill in")
        self.config.write_text(yaml.safe_dump(config))
        return self.config

    def up(self, timeout_s: float = 600) -> None:
        """`ray up`, then wait until every host's Ray node has joined."""
        self.render()
        self.cli("up", "-y", "--no-config-cache", str(self.config), timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.alive_nodes() < 1 + len(self.workers):
            if time.monotonic() > deadline:
                log = self.bed.hosts[self.head].ssh(f"tail -n 40 {AUTOSCALER_LOG}", check=False)
                raise RuntimeError(
                    f"the worker hosts did not join within {timeout_s:.0f} s; the head's "
                    f"autoscaler log ends:\n{log.stdout}{log.stderr}"
                )
            time.sleep(3)

    def alive_nodes(self) -> int:
        probe = "import ray; ray.init(address='auto'); print(sum(n['Alive'] for n in ray.nodes()))"
        home = "${VERICACHE_HOME:-$HOME/.vericache}"
        token = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={home}/ray_token"
        result = self.bed.hosts[self.head].ssh(
            f'source ~/.bashrc; {token} python -c "{probe}"', check=False
        )
        lines = result.stdout.strip().splitlines()
        return int(lines[-1]) if result.returncode == 0 and lines and lines[-1].isdigit() else 0

    def exec(self, command: str, timeout_s: float = 600) -> str:
        """`ray exec` on the head; its stdout."""
        return self.cli("exec", str(self.config), command, timeout=timeout_s)

    def down(self) -> None:
        """`ray down`, and forget this machine's record of the cluster."""
        subprocess.run([self.ray, "down", "-y", str(self.config)], capture_output=True,
                       timeout=300)  # fmt: skip
        for leftover in Path("/tmp/ray").glob(f"cluster-{self.bed.tag}.*"):
            leftover.unlink()

    def cli(self, *args: str, timeout: float) -> str:
        done = subprocess.run([self.ray, *args], capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            detail = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            raise RuntimeError(f"ray {args[0]} failed:\n{detail}")
        return done.stdout
