"""The sandbox's syscall filter: a seccomp BPF program that denies a run the kernel's surface no
program it runs needs (namespaces, keyrings, ptrace, mounts, bpf, perf, modules, io_uring, ...).

    program = syscall_filter()        # bytes of struct sock_filter, or None on an arch not known here

A denylist, not an allow-list: the sandbox runs Python and bash, which exec whatever tools they
like (compilers, interpreters, threads of numeric libraries), and the syscalls those use differ
by libc and version; an allow-list breaks one of them on some host, while what is denied here is
what no such program calls. Built by hand (no libseccomp): the launcher, standard library only,
loads it with prctl(PR_SET_SECCOMP) in each run's last process before the program starts.
"""

from __future__ import annotations

import errno
import os
import struct

# The syscalls denied (EPERM), by name; clone is denied only with a CLONE_NEW* flag, clone3 (its
# flags sit behind a pointer the filter cannot read) with ENOSYS, so libc falls back to clone.
DENIED = (
    # namespaces, keyrings (a uid's keyring outlives its run), other processes
    "unshare setns add_key request_key keyctl ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd "
    # mounts
    "mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig fsmount fspick mount_setattr "
    # the kernel itself, its clock, its name
    "bpf perf_event_open init_module finit_module delete_module kexec_load kexec_file_load reboot swapon swapoff "
    "acct syslog quotactl quotactl_fd lookup_dcookie settimeofday clock_settime clock_adjtime adjtimex "
    "sethostname setdomainname vhangup name_to_handle_at open_by_handle_at userfaultfd fanotify_init "
    "io_uring_setup io_uring_enter io_uring_register "
    # x86 only
    "iopl ioperm uselib nfsservctl _sysctl"
).split()


def _numbers(table: str) -> dict[str, int]:
    names_and_numbers = table.split()
    return dict(zip(names_and_numbers[::2], map(int, names_and_numbers[1::2])))


# From the kernel's unistd headers (tests/test_sandbox.py checks them against libseccomp's).
SYSCALLS = {
    "x86_64": _numbers(
        "clone 56 clone3 435 unshare 272 setns 308 add_key 248 request_key 249 keyctl 250 ptrace 101 "
        "process_vm_readv 310 process_vm_writev 311 kcmp 312 pidfd_getfd 438 mount 165 umount2 166 "
        "pivot_root 155 chroot 161 open_tree 428 move_mount 429 fsopen 430 fsconfig 431 fsmount 432 "
        "fspick 433 mount_setattr 442 bpf 321 perf_event_open 298 init_module 175 finit_module 313 "
        "delete_module 176 kexec_load 246 kexec_file_load 320 reboot 169 swapon 167 swapoff 168 acct 163 "
        "syslog 103 quotactl 179 quotactl_fd 443 lookup_dcookie 212 settimeofday 164 clock_settime 227 "
        "clock_adjtime 305 adjtimex 159 sethostname 170 setdomainname 171 vhangup 153 "
        "name_to_handle_at 303 open_by_handle_at 304 userfaultfd 323 fanotify_init 300 io_uring_setup 425 "
        "io_uring_enter 426 io_uring_register 427 iopl 172 ioperm 173 uselib 134 nfsservctl 180 "
        "_sysctl 156"
    ),
    "aarch64": _numbers(
        "clone 220 clone3 435 unshare 97 setns 268 add_key 217 request_key 218 keyctl 219 ptrace 117 "
        "process_vm_readv 270 process_vm_writev 271 kcmp 272 pidfd_getfd 438 mount 40 umount2 39 "
        "pivot_root 41 chroot 51 open_tree 428 move_mount 429 fsopen 430 fsconfig 431 fsmount 432 "
        "fspick 433 mount_setattr 442 bpf 280 perf_event_open 241 init_module 105 finit_module 273 "
        "delete_module 106 kexec_load 104 kexec_file_load 294 reboot 142 swapon 224 swapoff 225 acct 89 "
        "syslog 116 quotactl 60 quotactl_fd 443 lookup_dcookie 18 settimeofday 170 clock_settime 112 "
        "clock_adjtime 266 adjtimex 171 sethostname 161 setdomainname 162 vhangup 58 "
        "name_to_handle_at 264 open_by_handle_at 265 userfaultfd 282 fanotify_init 262 io_uring_setup 425 "
        "io_uring_enter 426 io_uring_register 427 nfsservctl 42"
    ),
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same syscalls under other numbers
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (NEWTIME is unshare's only)
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, BPF_RET|K
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
NR, ARCH, ARG0 = 0, 4, 16  # struct seccomp_data: nr, arch, args[0] (its low word: little-endian)


def syscall_filter(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (this host's by default) as struct sock_filter[]; None for an
    arch this module has no syscall numbers of."""
    machine = machine or os.uname().machine
    if machine not in SYSCALLS:
        return None
    nrs = SYSCALLS[machine]
    prog: list[tuple] = [(LD_ABS, 0, 0, ARCH), (JEQ, 0, "deny", AUDIT_ARCH[machine]), (LD_ABS, 0, 0, NR)]
    if machine == "x86_64":
        prog.append((JGE, "deny", 0, X32_SYSCALL_BIT))
    prog += [(JEQ, "enosys", 0, nrs["clone3"]), (JEQ, "clone", 0, nrs["clone"])]
    prog += [(JEQ, "deny", 0, nrs[name]) for name in DENIED if name in nrs]
    prog.append((RET, 0, 0, ALLOW))
    labels = {"clone": len(prog), "deny": len(prog) + 3, "enosys": len(prog) + 4}
    prog += [(LD_ABS, 0, 0, ARG0), (JSET, "deny", 0, CLONE_NEW), (RET, 0, 0, ALLOW)]
    prog += [(RET, 0, 0, ERRNO | errno.EPERM), (RET, 0, 0, ERRNO | errno.ENOSYS)]

    def jump(i: int, to: int | str) -> int:  # a label -> the instructions skipped to reach it
        return to if isinstance(to, int) else labels[to] - i - 1

    return b"".join(struct.pack("=HBBI", op, jump(i, jt), jump(i, jf), k) for i, (op, jt, jf, k) in enumerate(prog))
