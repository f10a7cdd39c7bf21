"""The sandbox's syscall filter: a seccomp BPF program that lets a run make the syscalls that
Python, bash and the tools they exec use (files, memory, threads, processes, signals, time,
pipes, local sockets, System V and POSIX IPC), and nothing else:

    program = syscall_filter()        # bytes of struct sock_filter, or None on an arch not known here

An allow-list: a syscall not on ALLOWED fails with ENOSYS, as on a kernel without it, so libc
falls back where it has a fallback (statx, faccessat2, clone3, ...) and a kernel's new surface
is closed until it is added here. DENIED, the kernel surface a run must never reach
(namespaces, keyrings, ptrace, mounts, bpf, perf, modules, io_uring, ...), fails with EPERM, as
clone does with a CLONE_NEW* flag. ALLOWED is Docker's default profile, less what a run has no
use for (the kernel's administration, the clock, fanotify, personality). Built by hand (no
libseccomp): the launcher (standard library only), or services/sandbox_exec.c for a program it
execs, loads it with prctl(PR_SET_SECCOMP) in each run's last process before the program starts.
"""

from __future__ import annotations

import errno
import os
import struct

ALLOWED = (
    # files and descriptors
    "read write readv writev pread64 pwrite64 preadv preadv2 pwritev pwritev2 lseek close close_range "
    "open openat openat2 creat stat fstat lstat newfstatat statx statfs fstatfs access faccessat faccessat2 "
    "dup dup2 dup3 pipe pipe2 fcntl flock ioctl fsync fdatasync sync syncfs sync_file_range fadvise64 "
    "readahead fallocate ftruncate truncate getcwd chdir fchdir rename renameat renameat2 mkdir mkdirat rmdir "
    "link linkat unlink unlinkat symlink symlinkat readlink readlinkat chmod fchmod fchmodat fchmodat2 chown "
    "fchown lchown fchownat utime utimes utimensat futimesat mknod mknodat getdents getdents64 "
    "getxattr lgetxattr fgetxattr setxattr lsetxattr fsetxattr listxattr llistxattr flistxattr removexattr "
    "lremovexattr fremovexattr sendfile copy_file_range splice tee vmsplice memfd_create "
    # memory, threads
    "mmap munmap mprotect mremap madvise mincore msync mlock mlock2 munlock mlockall munlockall brk membarrier "
    "futex futex_waitv set_robust_list get_robust_list rseq set_tid_address arch_prctl get_thread_area "
    "set_thread_area pkey_alloc pkey_free pkey_mprotect mbind get_mempolicy set_mempolicy "
    # signals, processes (clone: below), ids, limits, scheduling
    "rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending rt_sigsuspend rt_sigtimedwait rt_sigqueueinfo "
    "rt_tgsigqueueinfo sigaltstack kill tgkill tkill pidfd_open pidfd_send_signal pause restart_syscall "
    "fork vfork execve execveat exit exit_group wait4 waitid "
    "getpid getppid gettid getuid geteuid getgid getegid getgroups getresuid getresgid getpgid getpgrp getsid "
    "setpgid setsid setuid setgid setreuid setregid setresuid setresgid setgroups setfsuid setfsgid capget "
    "capset prctl seccomp landlock_create_ruleset landlock_add_rule landlock_restrict_self "
    "getrlimit setrlimit prlimit64 getrusage getpriority setpriority sched_yield sched_getaffinity "
    "sched_setaffinity sched_getparam sched_setparam sched_getscheduler sched_setscheduler "
    "sched_get_priority_max sched_get_priority_min sched_rr_get_interval sched_getattr sched_setattr getcpu "
    "ioprio_get ioprio_set uname sysinfo umask times "
    # time
    "time gettimeofday clock_gettime clock_getres clock_nanosleep nanosleep alarm getitimer setitimer "
    "timer_create timer_settime timer_gettime timer_getoverrun timer_delete timerfd_create timerfd_settime "
    "timerfd_gettime getrandom "
    # waiting on descriptors
    "poll ppoll select pselect6 epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2 "
    "eventfd eventfd2 signalfd signalfd4 inotify_init inotify_init1 inotify_add_watch inotify_rm_watch "
    "io_setup io_destroy io_submit io_cancel io_getevents io_pgetevents "
    # sockets (the run's network namespace has loopback only), IPC (its own IPC namespace)
    "socket socketpair bind listen accept accept4 connect getsockname getpeername getsockopt setsockopt "
    "shutdown sendto recvfrom sendmsg recvmsg sendmmsg recvmmsg "
    "shmget shmat shmdt shmctl semget semop semtimedop semctl msgget msgsnd msgrcv msgctl "
    "mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr"
).split()

# The syscalls denied with EPERM, by name; clone is denied only with a CLONE_NEW* flag, clone3 (its
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


# From the kernel's unistd headers, every name above that the arch has (tests/test_sandbox.py
# checks them against libseccomp's).
SYSCALLS = {
    "x86_64": _numbers(
        "clone 56 clone3 435 read 0 write 1 readv 19 writev 20 pread64 17 pwrite64 18 preadv 295 preadv2 "
        "327 pwritev 296 pwritev2 328 lseek 8 close 3 close_range 436 open 2 openat 257 openat2 437 creat "
        "85 stat 4 fstat 5 lstat 6 newfstatat 262 statx 332 statfs 137 fstatfs 138 access 21 faccessat "
        "269 faccessat2 439 dup 32 dup2 33 dup3 292 pipe 22 pipe2 293 fcntl 72 flock 73 ioctl 16 fsync 74 "
        "fdatasync 75 sync 162 syncfs 306 sync_file_range 277 fadvise64 221 readahead 187 fallocate 285 "
        "ftruncate 77 truncate 76 getcwd 79 chdir 80 fchdir 81 rename 82 renameat 264 renameat2 316 mkdir "
        "83 mkdirat 258 rmdir 84 link 86 linkat 265 unlink 87 unlinkat 263 symlink 88 symlinkat 266 "
        "readlink 89 readlinkat 267 chmod 90 fchmod 91 fchmodat 268 fchmodat2 452 chown 92 fchown 93 "
        "lchown 94 fchownat 260 utime 132 utimes 235 utimensat 280 futimesat 261 mknod 133 mknodat 259 "
        "getdents 78 getdents64 217 getxattr 191 lgetxattr 192 fgetxattr 193 setxattr 188 lsetxattr 189 "
        "fsetxattr 190 listxattr 194 llistxattr 195 flistxattr 196 removexattr 197 lremovexattr 198 "
        "fremovexattr 199 sendfile 40 copy_file_range 326 splice 275 tee 276 vmsplice 278 memfd_create "
        "319 mmap 9 munmap 11 mprotect 10 mremap 25 madvise 28 mincore 27 msync 26 mlock 149 mlock2 325 "
        "munlock 150 mlockall 151 munlockall 152 brk 12 membarrier 324 futex 202 futex_waitv 449 "
        "set_robust_list 273 get_robust_list 274 rseq 334 set_tid_address 218 arch_prctl 158 "
        "get_thread_area 211 set_thread_area 205 pkey_alloc 330 pkey_free 331 pkey_mprotect 329 mbind 237 "
        "get_mempolicy 239 set_mempolicy 238 rt_sigaction 13 rt_sigprocmask 14 rt_sigreturn 15 "
        "rt_sigpending 127 rt_sigsuspend 130 rt_sigtimedwait 128 rt_sigqueueinfo 129 rt_tgsigqueueinfo "
        "297 sigaltstack 131 kill 62 tgkill 234 tkill 200 pidfd_open 434 pidfd_send_signal 424 pause 34 "
        "restart_syscall 219 fork 57 vfork 58 execve 59 execveat 322 exit 60 exit_group 231 wait4 61 "
        "waitid 247 getpid 39 getppid 110 gettid 186 getuid 102 geteuid 107 getgid 104 getegid 108 "
        "getgroups 115 getresuid 118 getresgid 120 getpgid 121 getpgrp 111 getsid 124 setpgid 109 setsid "
        "112 setuid 105 setgid 106 setreuid 113 setregid 114 setresuid 117 setresgid 119 setgroups 116 "
        "setfsuid 122 setfsgid 123 capget 125 capset 126 prctl 157 seccomp 317 landlock_create_ruleset "
        "444 landlock_add_rule 445 landlock_restrict_self 446 getrlimit 97 setrlimit 160 prlimit64 302 "
        "getrusage 98 getpriority 140 setpriority 141 sched_yield 24 sched_getaffinity 204 "
        "sched_setaffinity 203 sched_getparam 143 sched_setparam 142 sched_getscheduler 145 "
        "sched_setscheduler 144 sched_get_priority_max 146 sched_get_priority_min 147 "
        "sched_rr_get_interval 148 sched_getattr 315 sched_setattr 314 getcpu 309 ioprio_get 252 "
        "ioprio_set 251 uname 63 sysinfo 99 umask 95 times 100 time 201 gettimeofday 96 clock_gettime 228 "
        "clock_getres 229 clock_nanosleep 230 nanosleep 35 alarm 37 getitimer 36 setitimer 38 "
        "timer_create 222 timer_settime 223 timer_gettime 224 timer_getoverrun 225 timer_delete 226 "
        "timerfd_create 283 timerfd_settime 286 timerfd_gettime 287 getrandom 318 poll 7 ppoll 271 select "
        "23 pselect6 270 epoll_create 213 epoll_create1 291 epoll_ctl 233 epoll_wait 232 epoll_pwait 281 "
        "epoll_pwait2 441 eventfd 284 eventfd2 290 signalfd 282 signalfd4 289 inotify_init 253 "
        "inotify_init1 294 inotify_add_watch 254 inotify_rm_watch 255 io_setup 206 io_destroy 207 "
        "io_submit 209 io_cancel 210 io_getevents 208 io_pgetevents 333 socket 41 socketpair 53 bind 49 "
        "listen 50 accept 43 accept4 288 connect 42 getsockname 51 getpeername 52 getsockopt 55 "
        "setsockopt 54 shutdown 48 sendto 44 recvfrom 45 sendmsg 46 recvmsg 47 sendmmsg 307 recvmmsg 299 "
        "shmget 29 shmat 30 shmdt 67 shmctl 31 semget 64 semop 65 semtimedop 220 semctl 66 msgget 68 "
        "msgsnd 69 msgrcv 70 msgctl 71 mq_open 240 mq_unlink 241 mq_timedsend 242 mq_timedreceive 243 "
        "mq_notify 244 mq_getsetattr 245 unshare 272 setns 308 add_key 248 request_key 249 keyctl 250 "
        "ptrace 101 process_vm_readv 310 process_vm_writev 311 kcmp 312 pidfd_getfd 438 mount 165 umount2 "
        "166 pivot_root 155 chroot 161 open_tree 428 move_mount 429 fsopen 430 fsconfig 431 fsmount 432 "
        "fspick 433 mount_setattr 442 bpf 321 perf_event_open 298 init_module 175 finit_module 313 "
        "delete_module 176 kexec_load 246 kexec_file_load 320 reboot 169 swapon 167 swapoff 168 acct 163 "
        "syslog 103 quotactl 179 quotactl_fd 443 lookup_dcookie 212 settimeofday 164 clock_settime 227 "
        "clock_adjtime 305 adjtimex 159 sethostname 170 setdomainname 171 vhangup 153 name_to_handle_at "
        "303 open_by_handle_at 304 userfaultfd 323 fanotify_init 300 io_uring_setup 425 io_uring_enter "
        "426 io_uring_register 427 iopl 172 ioperm 173 uselib 134 nfsservctl 180 _sysctl 156"
    ),
    "aarch64": _numbers(
        "clone 220 clone3 435 read 63 write 64 readv 65 writev 66 pread64 67 pwrite64 68 preadv 69 "
        "preadv2 286 pwritev 70 pwritev2 287 lseek 62 close 57 close_range 436 openat 56 openat2 437 "
        "fstat 80 newfstatat 79 statx 291 statfs 43 fstatfs 44 faccessat 48 faccessat2 439 dup 23 dup3 24 "
        "pipe2 59 fcntl 25 flock 32 ioctl 29 fsync 82 fdatasync 83 sync 81 syncfs 267 sync_file_range 84 "
        "fadvise64 223 readahead 213 fallocate 47 ftruncate 46 truncate 45 getcwd 17 chdir 49 fchdir 50 "
        "renameat 38 renameat2 276 mkdirat 34 linkat 37 unlinkat 35 symlinkat 36 readlinkat 78 fchmod 52 "
        "fchmodat 53 fchmodat2 452 fchown 55 fchownat 54 utimensat 88 mknodat 33 getdents64 61 getxattr 8 "
        "lgetxattr 9 fgetxattr 10 setxattr 5 lsetxattr 6 fsetxattr 7 listxattr 11 llistxattr 12 "
        "flistxattr 13 removexattr 14 lremovexattr 15 fremovexattr 16 sendfile 71 copy_file_range 285 "
        "splice 76 tee 77 vmsplice 75 memfd_create 279 mmap 222 munmap 215 mprotect 226 mremap 216 "
        "madvise 233 mincore 232 msync 227 mlock 228 mlock2 284 munlock 229 mlockall 230 munlockall 231 "
        "brk 214 membarrier 283 futex 98 futex_waitv 449 set_robust_list 99 get_robust_list 100 rseq 293 "
        "set_tid_address 96 pkey_alloc 289 pkey_free 290 pkey_mprotect 288 mbind 235 get_mempolicy 236 "
        "set_mempolicy 237 rt_sigaction 134 rt_sigprocmask 135 rt_sigreturn 139 rt_sigpending 136 "
        "rt_sigsuspend 133 rt_sigtimedwait 137 rt_sigqueueinfo 138 rt_tgsigqueueinfo 240 sigaltstack 132 "
        "kill 129 tgkill 131 tkill 130 pidfd_open 434 pidfd_send_signal 424 restart_syscall 128 execve "
        "221 execveat 281 exit 93 exit_group 94 wait4 260 waitid 95 getpid 172 getppid 173 gettid 178 "
        "getuid 174 geteuid 175 getgid 176 getegid 177 getgroups 158 getresuid 148 getresgid 150 getpgid "
        "155 getsid 156 setpgid 154 setsid 157 setuid 146 setgid 144 setreuid 145 setregid 143 setresuid "
        "147 setresgid 149 setgroups 159 setfsuid 151 setfsgid 152 capget 90 capset 91 prctl 167 seccomp "
        "277 landlock_create_ruleset 444 landlock_add_rule 445 landlock_restrict_self 446 getrlimit 163 "
        "setrlimit 164 prlimit64 261 getrusage 165 getpriority 141 setpriority 140 sched_yield 124 "
        "sched_getaffinity 123 sched_setaffinity 122 sched_getparam 121 sched_setparam 118 "
        "sched_getscheduler 120 sched_setscheduler 119 sched_get_priority_max 125 sched_get_priority_min "
        "126 sched_rr_get_interval 127 sched_getattr 275 sched_setattr 274 getcpu 168 ioprio_get 31 "
        "ioprio_set 30 uname 160 sysinfo 179 umask 166 times 153 gettimeofday 169 clock_gettime 113 "
        "clock_getres 114 clock_nanosleep 115 nanosleep 101 getitimer 102 setitimer 103 timer_create 107 "
        "timer_settime 110 timer_gettime 108 timer_getoverrun 109 timer_delete 111 timerfd_create 85 "
        "timerfd_settime 86 timerfd_gettime 87 getrandom 278 ppoll 73 pselect6 72 epoll_create1 20 "
        "epoll_ctl 21 epoll_pwait 22 epoll_pwait2 441 eventfd2 19 signalfd4 74 inotify_init1 26 "
        "inotify_add_watch 27 inotify_rm_watch 28 io_setup 0 io_destroy 1 io_submit 2 io_cancel 3 "
        "io_getevents 4 io_pgetevents 292 socket 198 socketpair 199 bind 200 listen 201 accept 202 "
        "accept4 242 connect 203 getsockname 204 getpeername 205 getsockopt 209 setsockopt 208 shutdown "
        "210 sendto 206 recvfrom 207 sendmsg 211 recvmsg 212 sendmmsg 269 recvmmsg 243 shmget 194 shmat "
        "196 shmdt 197 shmctl 195 semget 190 semop 193 semtimedop 192 semctl 191 msgget 186 msgsnd 189 "
        "msgrcv 188 msgctl 187 mq_open 180 mq_unlink 181 mq_timedsend 182 mq_timedreceive 183 mq_notify "
        "184 mq_getsetattr 185 unshare 97 setns 268 add_key 217 request_key 218 keyctl 219 ptrace 117 "
        "process_vm_readv 270 process_vm_writev 271 kcmp 272 pidfd_getfd 438 mount 40 umount2 39 "
        "pivot_root 41 chroot 51 open_tree 428 move_mount 429 fsopen 430 fsconfig 431 fsmount 432 fspick "
        "433 mount_setattr 442 bpf 280 perf_event_open 241 init_module 105 finit_module 273 delete_module "
        "106 kexec_load 104 kexec_file_load 294 reboot 142 swapon 224 swapoff 225 acct 89 syslog 116 "
        "quotactl 60 quotactl_fd 443 lookup_dcookie 18 settimeofday 170 clock_settime 112 clock_adjtime "
        "266 adjtimex 171 sethostname 161 setdomainname 162 vhangup 58 name_to_handle_at 264 "
        "open_by_handle_at 265 userfaultfd 282 fanotify_init 262 io_uring_setup 425 io_uring_enter 426 "
        "io_uring_register 427 nfsservctl 42"
    ),
}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same syscalls under other numbers
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET (NEWTIME is unshare's only)
CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

LD_ABS, JA, JEQ, JGE, JSET, RET = 0x20, 0x05, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|..|K, BPF_RET|K
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
NR, ARCH, ARG0 = 0, 4, 16  # struct seccomp_data: nr, arch, args[0] (its low word: little-endian)


def syscall_filter(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (this host's by default) as struct sock_filter[]; None for an
    arch this module has no syscall numbers of. After the arch, x32 and clone tests, a binary
    search over the ranges of syscall numbers that share a verdict: the kernel runs the filter
    for every syscall number when a run loads it (to cache the verdicts that need no argument),
    where a test per syscall in a row cost ~0.6 ms of each run."""
    machine = machine or os.uname().machine
    if machine not in SYSCALLS:
        return None
    nrs = SYSCALLS[machine]
    deny, enosys = ERRNO | errno.EPERM, ERRNO | errno.ENOSYS
    prog = [(LD_ABS, 0, 0, ARCH), (JEQ, 1, 0, AUDIT_ARCH[machine]), (RET, 0, 0, deny), (LD_ABS, 0, 0, NR)]
    if machine == "x86_64":
        prog += [(JGE, 0, 1, X32_SYSCALL_BIT), (RET, 0, 0, deny)]
    prog += [(JEQ, 0, 1, nrs["clone3"]), (RET, 0, 0, enosys)]
    # clone: its flags (the first argument's low word) without CLONE_NEW*, else EPERM
    prog += [(JEQ, 0, 4, nrs["clone"]), (LD_ABS, 0, 0, ARG0), (JSET, 0, 1, CLONE_NEW), (RET, 0, 0, deny)]
    prog.append((RET, 0, 0, ALLOW))
    verdicts = {nrs[n]: ALLOW for n in ALLOWED if n in nrs} | {nrs[n]: deny for n in DENIED if n in nrs}
    prog += _search(_ranges(verdicts, enosys))
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def _ranges(verdicts: dict[int, int], other: int) -> list[tuple[int, int]]:
    """(first number, verdict) of each run of numbers with one verdict, from 0 up; `other` for
    the numbers `verdicts` lacks (the last run: every number above them)."""
    ranges: list[tuple[int, int]] = []
    for nr in range(max(verdicts) + 2):
        verdict = verdicts.get(nr, other)
        if not ranges or ranges[-1][1] != verdict:
            ranges.append((nr, verdict))
    return ranges


def _search(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """Instructions that return the verdict of the range the loaded number falls in."""
    if len(ranges) == 1:
        return [(RET, 0, 0, ranges[0][1])]
    mid = len(ranges) // 2
    below, above = _search(ranges[:mid]), _search(ranges[mid:])
    if len(below) <= 255:  # a conditional jump's offset is 8 bits; past that, an unconditional one
        return [(JGE, len(below), 0, ranges[mid][0]), *below, *above]
    return [(JGE, 0, 1, ranges[mid][0]), (JA, 0, 0, len(below)), *below, *above]
