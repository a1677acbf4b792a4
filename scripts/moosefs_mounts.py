"""MooseFS for the benchmarks: a metadata master and two chunkservers in a network
namespace of their own (the chunkserver refuses a master on 127.0.0.0/8, so the namespace's
loopback also carries 10.213.0.1; no packet leaves it), seen through several independent
`mfsmount` clients, each with its own kernel caches. The same set-up as the tests'
substrate (tests/common/moosefs.rs).

    with MooseFsMounts(3, caches=1.0) as m:   # caches: None (MooseFS's defaults) or seconds
        m.mounts[i]                          # client i's view of one filesystem

Needs root and Debian's moosefs-master, moosefs-chunkserver and moosefs-client (scripts/test
installs them). `available()` says whether they are there.
"""
import os, shutil, subprocess, tempfile, time

ADDR = "10.213.0.1"


def _prog(name):
    return shutil.which(name) or os.path.join("/usr/sbin", name)


def available():
    return (os.geteuid() == 0 and all(os.path.exists(_prog(p)) for p in
                                       ("mfsmaster", "mfschunkserver", "mfsmount"))
            and os.path.exists("/var/lib/mfs/metadata.mfs.empty") and shutil.which("nsenter")
            and os.path.exists("/dev/fuse"))


class MooseFsMounts:
    def __init__(self, n, caches=None):
        self.n, self.caches = n, caches
        self.daemons, self.clients, self.mounts = [], [], []

    def _net(self, *cmd):
        return ["nsenter", f"--net=/run/netns/{self.netns}", *cmd]

    def __enter__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="rl-node-mfs-")
        r = self.tmp.name
        self.netns = f"rlmfs-bench-{os.getpid()}"
        try:
            subprocess.run(["ip", "netns", "add", self.netns], check=True)
            subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True)
            subprocess.run(["ip", "-n", self.netns, "addr", "add", f"{ADDR}/32", "dev", "lo"],
                           check=True)
            self._start_daemons(r)
            for i in range(self.n):
                self._mount(os.path.join(r, f"mnt{i}"))
            self._wait_writable()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _daemon(self, name, prog, cfg, ready):
        log = os.path.join(self.tmp.name, f"{name}.log")
        self.daemons.append(subprocess.Popen(
            self._net(_prog(prog), "-c", cfg, "-f", "start"), stdin=subprocess.DEVNULL,
            stdout=open(log, "w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while ready not in open(log).read():
            if time.monotonic() > deadline or self.daemons[-1].poll() is not None:
                raise RuntimeError(f"MooseFS {name} did not start:\n{open(log).read()[-2000:]}")
            time.sleep(0.05)

    def _start_daemons(self, r):
        os.mkdir(os.path.join(r, "master"))
        shutil.copy("/var/lib/mfs/metadata.mfs.empty", os.path.join(r, "master", "metadata.mfs"))
        with open(os.path.join(r, "exports.cfg"), "w") as f:
            f.write("* / rw,alldirs,admin,maproot=0\n")
        open(os.path.join(r, "topology.cfg"), "w").close()
        with open(os.path.join(r, "master.cfg"), "w") as f:
            f.write(f"WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {r}/master\n"
                    f"EXPORTS_FILENAME = {r}/exports.cfg\nTOPOLOGY_FILENAME = {r}/topology.cfg\n"
                    f"MATOML_LISTEN_HOST = {ADDR}\nMATOCS_LISTEN_HOST = {ADDR}\n"
                    f"MATOCL_LISTEN_HOST = {ADDR}\nNICE_LEVEL = 0\nLOCK_MEMORY = 0\n")
        self._daemon("master", "mfsmaster", os.path.join(r, "master.cfg"),
                     "daemon initialized properly")
        for n in (1, 2):
            os.mkdir(os.path.join(r, f"cs{n}"))
            os.mkdir(os.path.join(r, f"cs{n}-data"))
            with open(os.path.join(r, f"hdd{n}.cfg"), "w") as f:
                f.write(f"{r}/cs{n}-data\n")
            with open(os.path.join(r, f"cs{n}.cfg"), "w") as f:
                f.write(f"WORKING_USER = root\nWORKING_GROUP = root\nDATA_PATH = {r}/cs{n}\n"
                        f"HDD_CONF_FILENAME = {r}/hdd{n}.cfg\nMASTER_HOST = {ADDR}\n"
                        f"BIND_HOST = {ADDR}\nCSSERV_LISTEN_HOST = {ADDR}\n"
                        f"CSSERV_LISTEN_PORT = 94{n}2\nHDD_LEAVE_SPACE_DEFAULT = 64MiB\n"
                        f"NICE_LEVEL = 0\n")
            self._daemon(f"cs{n}", "mfschunkserver", os.path.join(r, f"cs{n}.cfg"),
                         "connected to Master")

    def _mount(self, at):
        os.mkdir(at)
        cmd = self._net(_prog("mfsmount"), at, "-f", "-H", ADDR)
        if self.caches is not None:
            c = self.caches
            cmd += ["-o", f"mfsattrcacheto={c},mfsentrycacheto={c},mfsdirentrycacheto={c},"
                          f"mfsnegentrycacheto={c}"]
        self.clients.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        while not os.path.ismount(at):
            if time.monotonic() > deadline:
                raise RuntimeError(f"mfsmount {at} did not mount")
            time.sleep(0.05)
        self.mounts.append(at)

    def _wait_writable(self):
        probe, seen = (os.path.join(self.mounts[0], ".probe"),
                       os.path.join(self.mounts[-1], ".probe"))
        deadline = time.monotonic() + 60
        while True:
            try:
                with open(probe, "w") as f:
                    f.write("ready")
                with open(seen) as f:
                    if f.read() == "ready":
                        os.remove(probe)
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("MooseFS took no data")
            time.sleep(0.2)

    def __exit__(self, *exc):
        for at in reversed(self.mounts):
            subprocess.run(["umount", "-l", at], stderr=subprocess.DEVNULL)
        for p in self.clients + list(reversed(self.daemons)):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        subprocess.run(["ip", "netns", "delete", self.netns], stderr=subprocess.DEVNULL)
        self.tmp.cleanup()
        return False
