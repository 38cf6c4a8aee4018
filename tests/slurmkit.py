"""A real SLURM on this machine: slurmctld and three slurmd, each slurmd a node in its own network
and UTS namespace (its own hostname and address), one munged for all. Set up once per test
session (about 1.5 s, teardown about 2 s).

Debian's ``slurm-wlm`` and ``munge`` (.ci/run installs them). Nothing in /etc is touched: node
names resolve through a private hosts file bind-mounted over /etc/hosts inside each daemon's own
mount namespace (the tasks inherit it); slurmd is entered into its namespace with ``nsenter
--net`` (``ip netns exec`` remounts /sys, and slurmd 22.05 then finds no cgroup filesystem and
exits). Clients (``srun``, ``sbatch``, ``scancel``) run here with ``SLURM_CONF`` pointing at the
kit's own slurm.conf. Names are fixed (bridge ``slbr0``, namespaces ``sln1..3``, 10.77.0.0/24,
slurmctld on port 6817): one kit per machine at a time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .hostkit import skip_or_fail

NODES = ("sln1", "sln2", "sln3")
DAEMONS = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")
MUNGE_KEY = Path("/etc/munge/munge.key")

CONF = """\
ClusterName=flodltest
SlurmctldHost=ctl(10.77.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={work}/munge/munge.socket
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool/%n
SlurmctldPidFile={work}/run/slurmctld.pid
SlurmdPidFile={work}/run/slurmd-%n.pid
SlurmctldLogFile={work}/log/slurmctld.log
SlurmdLogFile={work}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


#: A daemon's namespace: the kit's hosts file over /etc/hosts, its own hostname ($0), then the
#: daemon ($@).
_BIND_HOSTS = 'mount --bind {work}/hosts /etc/hosts && hostname "$0" && exec "$@"'


def missing_requirements() -> str | None:
    """Why a SLURM kit cannot be made here, or None."""
    if os.geteuid() != 0:
        return "the SLURM kit needs root (namespaces, a bridge, SlurmUser=root)"
    for daemon in DAEMONS:
        if not Path(daemon).exists():
            return f"{daemon} is missing (apt-get install slurm-wlm munge)"
    if not MUNGE_KEY.exists():
        return f"{MUNGE_KEY} is missing (the munge package makes it)"
    if shutil.which("nsenter") is None:
        return "nsenter is missing (apt-get install util-linux)"
    return None


def require_slurm() -> None:
    """Skip without SLURM here; under CI, fail (.ci/run installs it)."""
    skip_or_fail(missing_requirements(), "SLURM")


def _run(*argv: str, check: bool = True, env: dict[str, str] | None = None) -> str:
    return subprocess.run(
        argv, check=check, capture_output=True, text=True, timeout=60, env=env
    ).stdout


@dataclass
class SlurmKit:
    """A running SLURM: its work directory and the environment its clients need."""

    work: Path
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with the kit's ``SLURM_CONF`` (srun passes it on to tasks)."""
        return {**os.environ, "SLURM_CONF": str(self.work / "slurm.conf")}

    @classmethod
    def create(cls) -> SlurmKit:
        work = Path(tempfile.mkdtemp(prefix="flodl-slurm-"))
        kit = cls(work=work)
        try:
            kit._start()
        except BaseException:
            kit.close()
            raise
        return kit

    def _start(self) -> None:
        work = self.work
        os.chmod(work, 0o755)  # munged (user munge) must reach its socket directory
        for sub in ("munge", "state", "run", "log", *(f"spool/{n}" for n in NODES)):
            (work / sub).mkdir(parents=True)
        shutil.chown(work / "munge", "munge", "munge")
        nodes = "\n".join(
            f"NodeName={n} NodeAddr=10.77.0.1{i} NodeHostname={n} CPUs=4 State=UNKNOWN"
            for i, n in enumerate(NODES, 1)
        )
        (work / "slurm.conf").write_text(CONF.format(work=work, nodes=nodes))
        hosts = Path("/etc/hosts").read_text()
        hosts += "\n10.77.0.1 ctl\n" + "".join(
            f"10.77.0.1{i} {n}\n" for i, n in enumerate(NODES, 1)
        )
        (work / "hosts").write_text(hosts)
        _run("ip", "link", "add", "slbr0", "type", "bridge")
        _run("ip", "addr", "add", "10.77.0.1/24", "dev", "slbr0")
        _run("ip", "link", "set", "slbr0", "up")
        for i, n in enumerate(NODES, 1):
            _run("ip", "netns", "add", n)
            _run("ip", "link", "add", f"slv{i}", "type", "veth", "peer", "name", "eth0", "netns", n)
            _run("ip", "link", "set", f"slv{i}", "master", "slbr0", "up")
            _run("ip", "-n", n, "addr", "add", f"10.77.0.1{i}/24", "dev", "eth0")
            _run("ip", "-n", n, "link", "set", "eth0", "up")
            _run("ip", "-n", n, "link", "set", "lo", "up")
        sock = work / "munge" / "munge.socket"
        _run(
            "runuser",
            "-u",
            "munge",
            "--",
            "/usr/sbin/munged",
            f"--socket={sock}",
            f"--key-file={MUNGE_KEY}",
            f"--pid-file={work}/munge/munged.pid",
            f"--log-file={work}/munge/munged.log",
            f"--seed-file={work}/munge/munged.seed",
        )
        conf = str(work / "slurm.conf")
        # each daemon in its own UTS and mount namespace: its hostname, the kit's hosts file
        inside = ("unshare", "--uts", "--mount", "sh", "-c", _BIND_HOSTS.format(work=work))
        daemons = [("slurmctld", (), ("ctl", "/usr/sbin/slurmctld", "-D", "-i"))]
        daemons += [
            (
                f"slurmd-{n}",
                ("nsenter", f"--net=/run/netns/{n}"),
                (n, "/usr/sbin/slurmd", "-D", "-N", n),
            )
            for n in NODES
        ]
        for name, netns, argv in daemons:
            self._spawn(name, ["setsid", *netns, *inside, *argv, "-f", conf])
        deadline = time.monotonic() + 30
        while True:  # no event to wait on: slurmctld's view of the nodes
            states = _run("sinfo", "-h", "-N", "-o", "%t", check=False, env=self.env).split()
            if states.count("idle") == len(NODES):
                return
            if time.monotonic() > deadline:
                log = (work / "log" / "slurmctld.log").read_text()[-2000:]
                raise RuntimeError(f"SLURM nodes not idle within 30s ({states}): {log}")
            time.sleep(0.1)

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.work / "log" / f"{name}.out", "wb")  # noqa: SIM115 -- the daemon's, for its life
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        out.close()
        self._procs.append(proc)
        # setsid, nsenter, unshare and sh all exec: this pid is the daemon's
        (self.work / "run" / f"{name}.launcher.pid").write_text(str(proc.pid))

    def node_pids(self) -> dict[str, list[int]]:
        """Every process on each node but its slurmd (empty: nothing left there)."""
        daemons = set(self._daemon_pids())
        out = {}
        for n in NODES:
            pids = [int(p) for p in _run("ip", "netns", "pids", n, check=False).split()]
            left = [p for p in pids if p not in daemons]
            if left:
                out[n] = left
        return out

    def leftovers(self, within: float = 10.0) -> dict[str, list[int]]:
        deadline = time.monotonic() + within
        while (left := self.node_pids()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def _daemon_pids(self) -> list[int]:
        pids = []
        for f in (self.work / "run").glob("*.launcher.pid"):
            with contextlib.suppress(ValueError, OSError):
                pids.append(int(f.read_text()))
        return pids

    def close(self) -> None:
        with contextlib.suppress(Exception):
            _run("scancel", "--quiet", "--user=root", check=False, env=self.env)
        pids = set(self._daemon_pids())
        with contextlib.suppress(OSError, ValueError):
            pids.add(int((self.work / "munge" / "munged.pid").read_text()))
        for n in NODES:
            pids.update(int(p) for p in _run("ip", "netns", "pids", n, check=False).split())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for proc in self._procs:  # our children: reaped, or they would linger as zombies
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for i, n in enumerate(NODES, 1):
            _run("ip", "netns", "del", n, check=False)
            _run("ip", "link", "del", f"slv{i}", check=False)
        _run("ip", "link", "del", "slbr0", check=False)
        shutil.rmtree(self.work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
