"""Loopback sshfs mounts for the benchmarks: one exported directory seen through several
independent sshfs clients (each with its own kernel attribute and negative-lookup caches),
like NFS clients of one server. The same options as the tests' substrate
(tests/common/sshfs.rs): cache_timeout and negative_timeout of `cache_s` seconds,
attr_timeout=0 (close-to-open consistency).

    with SshfsMounts(3, cache_s=5) as m:
        m.mounts[i]   # client i's view of m.export

Needs sshfs, openssh-server and fuse3 (scripts/test installs them) and root or a usable
/dev/fuse. `available()` says whether they are there.
"""
import os, shutil, socket, subprocess, tempfile, time

SSHD = "/usr/sbin/sshd"


def available():
    return (shutil.which("sshfs") and os.access(SSHD, os.X_OK) and shutil.which("ssh-keygen")
            and (shutil.which("fusermount3") or shutil.which("fusermount"))
            and os.path.exists("/dev/fuse"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SshfsMounts:
    def __init__(self, n, cache_s=5):
        self.n, self.cache_s = n, cache_s
        self.procs, self.mounts = [], []

    def __enter__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="rl-node-sshfs-")
        root = self.tmp.name
        self.export = os.path.join(root, "export")
        os.mkdir(self.export)
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                            os.path.join(root, name)], check=True, stdin=subprocess.DEVNULL)
        os.makedirs("/run/sshd", exist_ok=True)
        port = _free_port()
        cfg = os.path.join(root, "sshd_config")
        with open(cfg, "w") as f:
            f.write(f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {root}/host_key\n"
                    f"AuthorizedKeysFile {root}/client_key.pub\nPubkeyAuthentication yes\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                    "PermitRootLogin yes\nStrictModes no\nUsePAM no\nUseDNS no\n"
                    f"PidFile {root}/sshd.pid\nSubsystem sftp internal-sftp\nMaxStartups 100\n")
        self.sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", cfg], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.sshd.poll() is not None:
                    self.__exit__(None, None, None)
                    raise RuntimeError("sshd did not start")
                time.sleep(0.05)
        user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
        opts = (f"IdentityFile={root}/client_key,StrictHostKeyChecking=no,"
                "UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR,"
                f"cache_timeout={self.cache_s},negative_timeout={self.cache_s},attr_timeout=0")
        for i in range(self.n):
            d = os.path.join(root, f"mnt{i}")
            os.mkdir(d)
            self.procs.append(subprocess.Popen(
                ["sshfs", "-f", "-p", str(port), "-o", opts, f"{user}@127.0.0.1:{self.export}", d],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.mounts.append(d)
        deadline = time.monotonic() + 20
        for d in self.mounts:
            while not os.path.ismount(d):
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"sshfs did not mount {d}")
                time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        fuse = shutil.which("fusermount3") or shutil.which("fusermount")
        for d in self.mounts:
            subprocess.run([fuse, "-u", "-z", d], stderr=subprocess.DEVNULL)
        for p in self.procs + [getattr(self, "sshd", None)]:
            if p is not None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.tmp.cleanup()
