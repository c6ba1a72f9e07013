"""PID 1 of a sandbox (:mod:`distrl.rollout.envs.sandbox` starts it): set the box up, run the untrusted program
as its child, report how it ended.

It runs as ``python -I -S sandbox_init.py SPEC`` under ``unshare --mount --net --pid --ipc --uts --fork
--kill-child --mount-proc`` (plus ``--user --map-root-user`` when the caller is not root), so it is PID 1 of fresh
namespaces and still holds root's capabilities there. SPEC is JSON (see ``sandbox.py``); the program's source comes
on stdin. Steps, in order (a failure before the program starts prints ``SETUP_FAILED: ...`` on stderr and exits
125, nothing is run):

1. refuse to go on if its mount namespace is the caller's (a missing ``--mount`` must not touch the host's mounts);
2. make every mount read-only and nosuid (``mount_setattr(2)``, recursive);
3. build a new root on a private tmpfs (``size`` = the file limit): read-only binds of the system directories
   (``/usr``, ``/lib*``, ``/bin``, ``/etc``), of the interpreter's prefix at ``/python`` (the caller's prefix may
   sit under a directory the sandbox uid cannot enter, e.g. ``/root``) and of ``/dev/null``, ``/dev/zero``,
   ``/dev/urandom``, ``/dev/random``; a writable ``/tmp`` holding the program, ``/tmp/main.py``; nothing else of
   the host (no ``/proc``, ``/sys``, ``/run``, home or work directories, no host sockets); ``chroot`` into it;
4. set the rlimits; drop to the sandbox uid/gid (no groups: every capability goes, ``chroot`` included) where
   the caller was root; set no_new_privs;
5. Landlock (``landlock_create_ruleset(2)`` ...): reads and execution only beneath the interpreter and system
   library directories, writes only beneath ``/tmp``, no TCP bind or connect, no signals or abstract unix sockets
   out of the sandbox (as far as the kernel's Landlock ABI goes);
6. fork: the child ``execve``s the interpreter on ``/tmp/main.py`` with a clean environment and no stdin; PID 1
   (under every restriction above too) reaps until it ends, writes its exit status (minus the signal that ended
   it) to SPEC's ``status_fd`` and exits, which kills whatever the program left running.

Standard library only: it runs before any sandboxing and must not import the checkout.
"""

import ctypes
import json
import os
import resource
import sys

SETUP_FAILED = "SETUP_FAILED"
SYS_MOUNT_SETATTR, SYS_LANDLOCK_CREATE, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT = 442, 444, 445, 446
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 0x2, 0x4, 0x1000, 0x4000
PR_SET_NO_NEW_PRIVS = 38
# Landlock access rights (linux/landlock.h) and the ABI version that brought each
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | (1 << 14) | (1 << 15)  # rights a file rule may hold
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
RULE_PATH_BENEATH = 1
NEW_ROOT = "/tmp"  # where the sandbox's root is built (a tmpfs mounted over the namespace's /tmp), then chroot
PYTHON = "/python"  # where the interpreter's prefix is bound in the new root
READ_ONLY_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc")  # system libraries and the loader's cache
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")

libc = ctypes.CDLL(None, use_errno=True)


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def check(result: int, what: str) -> int:
    """``result`` of a libc call, or OSError naming ``what`` when it is -1."""
    if result == -1:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return result


def read_only(path: str) -> None:
    """Every mount at and beneath ``path`` read-only and nosuid (this mount namespace only)."""
    attr = MountAttr(attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, ctypes.byref(attr),
                       ctypes.sizeof(attr)), f"mount_setattr {path}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                     data.encode() if data else None), f"mount {source} on {target}")


def bind(source: str, target: str) -> None:
    """Bind ``source`` read-only at ``target`` (a new mount point: a directory, or an empty file for a file); a
    symlink is copied as a symlink; a missing source is skipped."""
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    if not os.path.exists(source):
        return
    if os.path.isdir(source):
        os.makedirs(target, 0o755)
    else:
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    mount(source, target, None, MS_BIND | MS_REC)
    read_only(target)


def build_tree(spec: dict, code: bytes) -> None:
    """Steps 2-4's mounts, then ``chroot`` into the new root (the working directory: /tmp)."""
    read_only("/")
    mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['file_bytes']},nr_inodes=4096,mode=0755")
    for path in READ_ONLY_DIRS:
        bind(path, NEW_ROOT + path)
    bind(spec["prefix"], NEW_ROOT + PYTHON)
    os.mkdir(NEW_ROOT + "/dev", 0o755)
    for path in DEVICES:
        bind(path, NEW_ROOT + path)
    os.mkdir(NEW_ROOT + "/tmp", 0o1777)
    os.chmod(NEW_ROOT + "/tmp", 0o1777)  # past the umask
    with open(NEW_ROOT + "/tmp/main.py", "wb") as f:
        f.write(code)
    os.chown(NEW_ROOT + "/tmp/main.py", spec["uid"], spec["uid"])
    os.chroot(NEW_ROOT)
    os.chdir("/tmp")


def set_limits(spec: dict) -> None:
    """The rlimits (soft = hard, so the program cannot raise them): CPU seconds, address space, processes,
    file size, open files, no core files."""
    for name, value in (("RLIMIT_CPU", spec["cpu_s"]), ("RLIMIT_AS", spec["memory_bytes"]),
                        ("RLIMIT_NPROC", spec["processes"]), ("RLIMIT_FSIZE", spec["file_bytes"]),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def drop_privileges(uid: int) -> None:
    """Become ``uid``/``uid`` with no supplementary groups (from root this clears every capability); then
    no_new_privs (nothing executed later can gain privileges; Landlock needs it)."""
    if os.getuid() == 0 and uid != 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError(f"setresuid({uid}) did not take")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none or disabled)."""
    version = libc.syscall(SYS_LANDLOCK_CREATE, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    return max(version, 0)


def allow(ruleset: int, path: str, rights: int) -> None:
    """Grant ``rights`` beneath ``path`` (a file gets only the rights a file can have); missing paths are
    skipped."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not os.path.isdir(path):
            rights &= FS_FILE_RIGHTS
        rule = PathBeneath(allowed_access=rights, parent_fd=fd)
        check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), 0),
              f"landlock_add_rule {path}")
    finally:
        os.close(fd)


def landlock(spec: dict) -> int:
    """Step 5; returns the ABI version used. Raises OSError when the kernel has no Landlock."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError("Landlock is not available (kernel without it, or not in the lsm= list)")
    handled = FS_ALL_BY_ABI[max(v for v in FS_ALL_BY_ABI if v <= abi)]
    attr = RulesetAttr(handled_access_fs=handled,
                       handled_access_net=(NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 else 0,
                       scoped=(SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0)
    size = ctypes.sizeof(attr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = check(libc.syscall(SYS_LANDLOCK_CREATE, ctypes.byref(attr), size, 0), "landlock_create_ruleset")
    read_exec = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    for path in READ_ONLY_DIRS:
        allow(ruleset, path, read_exec)
    allow(ruleset, PYTHON, read_exec)
    for path in DEVICES:
        allow(ruleset, path, FS_READ_FILE | FS_WRITE_FILE)
    allow(ruleset, "/tmp", handled)
    check(libc.syscall(SYS_LANDLOCK_RESTRICT, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)
    return abi


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        if os.stat("/proc/self/ns/mnt").st_ino == spec["host_mnt_ns"]:
            raise OSError("not in a mount namespace of its own")
        code = sys.stdin.buffer.read()
        build_tree(spec, code)
        set_limits(spec)
        drop_privileges(spec["uid"])
        landlock(spec)
        fd = os.open("/dev/null", os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        pid = os.fork()
        if pid == 0:
            os.close(spec["status_fd"])
            start_program(spec)
    except OSError as exc:
        print(f"{SETUP_FAILED}: {exc}", file=sys.stderr, flush=True)
        os._exit(125)
    os._exit(reap_until(pid, spec["status_fd"]))


def start_program(spec: dict) -> None:
    """Step 6, in the child of PID 1: ``execve`` the interpreter on /tmp/main.py (never returns)."""
    exe = f"{PYTHON}/{spec['exe']}"
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
           "LD_LIBRARY_PATH": f"{PYTHON}/lib", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    try:
        os.execve(exe, [exe, "-I", "-B", "-u", "/tmp/main.py"], env)
    except OSError as exc:
        print(f"{SETUP_FAILED}: execve {exe}: {exc}", file=sys.stderr, flush=True)
        os._exit(125)


def reap_until(pid: int, status_fd: int) -> int:
    """PID 1's work: reap every process until the program ``pid`` ends, write its exit status (minus the signal
    that ended it) to ``status_fd``, and return it as an exit status. PID 1 exiting then kills the rest."""
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            code = os.waitstatus_to_exitcode(status)
            os.write(status_fd, f"{code}\n".encode())
            return code if code >= 0 else 128 - code


if __name__ == "__main__":
    main()
