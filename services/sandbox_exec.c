/* The sandbox's exec path: runs of a program the sandbox execs (bash, a binary), set up as
 * services/sandbox_launcher.py's run() sets up a forked one, in small processes instead of
 * copies of the launcher's interpreter. Forking a Python process, its children's page faults
 * and their exits were ~80% of such a run's cost; this is the launcher's thinnest replacement
 * for them (the sandbox compiles it on start, with the host's C compiler).
 * It is freestanding (raw system calls, no C library): a static libc's start-up (its CPU
 * feature probes trap to the hypervisor in a VM) and its pages' faults in each process cost as
 * much again as the rest of the helper.
 *
 *   sandbox_exec SPEC... -- PROGRAM ARGS...   (one run without namespaces; spawned by the pool, its session leader)
 *   fds: 0-4 the run's stdin, stdout, stderr, report, tests; 5 the set-up pipe (why the sandbox
 *   could not be set up; closed before the program runs); 6 and 7 the slot's network and mount
 *   namespaces (a server's); from 8, NCGROUPS cgroup.procs files to join. SPEC, in order:
 *     NAMESPACES(0|1) UID(-1: keep) CWD NCGROUPS NTMPFS (TARGET OPTIONS)...
 *     NRLIMITS (RESOURCE VALUE)... FILTER(hex, or -)
 *   Exits with the program's code, 128 + the signal that ended it, or 125 if set-up failed.
 *
 *   sandbox_exec serve SPEC... --   (a slot's server: NAMESPACES 1, NRLIMITS 0)
 *   The slot's runs, one after another, in one pid and mount namespace made once: with
 *   namespaces, making them and the run's mounts per run cost more than the rest of the helper.
 *   fds: 3 the control socket (SOCK_SEQPACKET), 5 the set-up pipe, 6-7 and 8+ as above. Its pid 1
 *   sends "R" once set up, then serves requests: "CWD\0NRLIMITS\0(RESOURCE\0VALUE\0)...PROGRAM\0ARGS\0..."
 *   with six fds (the run's 0-4 and its set-up pipe); answers each with the run's exit code
 *   (4 bytes, as above) once every process of the run is gone and nothing it left in the
 *   namespace's tmpfs, SysV IPC or pid numbers can reach the next run. It exits when the socket
 *   closes; killing its pid 1 ends it and the run in it.
 */
#include <asm/unistd.h>
#include <linux/fcntl.h>
#include <linux/filter.h>
#include <linux/prctl.h>
#include <linux/sched.h>
#include <linux/seccomp.h>
#include <linux/signal.h>
#include <linux/stat.h>
#include <asm/statfs.h>
#include <linux/wait.h>

#if !defined(__x86_64__) && !defined(__aarch64__)
#error "sandbox_exec.c: system calls for x86_64 and aarch64 only (elsewhere the launcher forks)"
#endif

#define MS_NOSUID 2
#define MS_NODEV 4
#define MS_NOEXEC 8
#define MNT_DETACH 2
#define SOL_SOCKET 1
#define SCM_RIGHTS 1
#define MSG_CTRUNC 8
#define MSG_CMSG_CLOEXEC 0x40000000
#define BPF_MAXINSNS 4096
#define IPC_RMID 0

typedef unsigned long size_t;
typedef unsigned long long u64;

static long sys6(long n, long a, long b, long c, long d, long e, long f) {
#if defined(__x86_64__)
    register long r10 __asm__("r10") = d, r8 __asm__("r8") = e, r9 __asm__("r9") = f;
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
#else
    register long x8 __asm__("x8") = n, x0 __asm__("x0") = a, x1 __asm__("x1") = b, x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d, x4 __asm__("x4") = e, x5 __asm__("x5") = f;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
    return x0;
#endif
}
#define sys(...) sys6_(__VA_ARGS__, 0, 0, 0, 0, 0, 0, 0)
#define sys6_(n, a, b, c, d, e, f, ...) sys6(n, (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), (long)(f))

/* What the compiler may call for struct copies and zeroing, with no C library to provide them. */
void *memset(void *dst, int c, size_t n) {
    unsigned char *d = dst;
    while (n--) *d++ = (unsigned char)c;
    return dst;
}

void *memcpy(void *dst, const void *src, size_t n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    while (n--) *d++ = *s++;
    return dst;
}

static size_t length(const char *s) {
    size_t n = 0;
    while (s[n]) n++;
    return n;
}

static int same(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

static u64 number(const char *s) {
    u64 v = 0;
    while (*s >= '0' && *s <= '9') v = v * 10 + (u64)(*s++ - '0');
    return v;
}

static long integer(const char *s) {
    return *s == '-' ? -(long)number(s + 1) : (long)number(s);
}

/* `v` in decimal at the end of `buf` (room for 21 characters); returns its first character. */
static char *decimal(u64 v, char *end) {
    *--end = 0;
    do *--end = (char)('0' + v % 10);
    while (v /= 10);
    return end;
}

static void __attribute__((noreturn)) leave(int code) {
    for (;;) sys(__NR_exit_group, code);
}
enum { CONTROL_FD = 3, SETUP_FD = 5, NETNS_FD = 6, MNTNS_FD = 7, CGROUPS_FD = 8, SETUP_FAILED = 125 };

/* The names of the errors a set-up step may meet; others by number. */
static const char *const ERRORS[] = {
    [1] = "Operation not permitted", [2] = "No such file or directory", [4] = "Interrupted system call",
    [9] = "Bad file descriptor",     [11] = "Resource temporarily unavailable", [12] = "Cannot allocate memory",
    [13] = "Permission denied",      [16] = "Device or resource busy", [17] = "File exists",
    [20] = "Not a directory",        [22] = "Invalid argument", [24] = "Too many open files",
    [28] = "No space left on device", [36] = "File name too long", [38] = "Function not implemented",
};

/* "OSError: WHAT: WHY" to set-up pipe `fd`; returns 125. `err`: the failed call's (negative) return. */
static int tell(long fd, const char *what, long err) {
    char msg[512], num[24];
    size_t n = 0;
    const char *why = -err > 0 && -err < (long)(sizeof ERRORS / sizeof *ERRORS) ? ERRORS[-err] : 0;
    const char *parts[] = {"OSError: ", what, ": ", why ? why : "error ", why ? "" : decimal((u64)-err, num + 24)};
    for (size_t p = 0; p < sizeof parts / sizeof *parts; p++) {
        for (const char *c = parts[p]; *c && n < sizeof msg; c++) msg[n++] = *c;
    }
    sys(__NR_write, fd, msg, n); /* nothing left to tell it with if this fails */
    return SETUP_FAILED;
}

/* Why set-up failed, to the set-up pipe; exit 125. */
static void __attribute__((noreturn)) fail(const char *what, long err) {
    leave(tell(SETUP_FD, what, err));
}

static long check(long result, const char *what) {
    if (result < 0) fail(what, result);
    return result;
}

/* How `pid` ended, as a shell gives it (128 + the signal that ended it), once it has. */
static int wait_code(long pid) {
    int status = 0;
    long r;
    while ((r = sys(__NR_wait4, pid, &status, 0, 0)) < 0) {
        if (r != -4) return SETUP_FAILED; /* but EINTR */
    }
    int signal = status & 0x7f;
    return signal ? 128 + signal : (status >> 8) & 0xff;
}

/* Wait for `pid`; exit as it did. The set-up pipe is closed first: only the program's process,
 * before it execs, may still write to it. */
static void __attribute__((noreturn)) exit_as(long pid) {
    sys(__NR_close, SETUP_FD);
    leave(wait_code(pid));
}

static void write_fd(long fd, const char *text, const char *what) {
    check(sys(__NR_write, fd, text, length(text)), what);
}

static void write_file(const char *path, const char *text) {
    long fd = check(sys(__NR_openat, AT_FDCWD, path, O_WRONLY | O_CLOEXEC), path);
    write_fd(fd, text, path);
    sys(__NR_close, fd);
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* The syscall filter's instructions from hex (sandbox_seccomp.py's bytes), into `out`; 0 for "-". */
static unsigned short parse_filter(const char *hex, struct sock_filter *out) {
    size_t n = length(hex) / 2;
    if (same(hex, "-")) return 0;
    if (n == 0 || n % sizeof(struct sock_filter) || n / sizeof(struct sock_filter) > BPF_MAXINSNS) {
        fail("the syscall filter", -22);
    }
    unsigned char *bytes = (unsigned char *)out;
    for (size_t i = 0; i < n; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) fail("the syscall filter", -22);
        bytes[i] = (unsigned char)(hi << 4 | lo);
    }
    return (unsigned short)(n / sizeof(struct sock_filter));
}

struct spec {
    int namespaces;
    long uid;
    const char *cwd;
    int ncgroups, ntmpfs, nrlimits;
    char **tmpfs, **rlimits;
    const char *filter;
    char **argv;
};

static int count(int i, int argc, char **argv, int per, int *n) {
    if (i >= argc) return -1;
    *n = (int)integer(argv[i]);
    return *n < 0 || i + 1 + *n * per > argc ? -1 : i + 1 + *n * per;
}

static int parse(int argc, char **argv, struct spec *s) {
    int i = 1;
    if (argc < 5) return -1;
    s->namespaces = (int)integer(argv[i++]);
    s->uid = integer(argv[i++]);
    s->cwd = argv[i++];
    if ((i = count(i, argc, argv, 0, &s->ncgroups)) < 0) return -1;
    s->tmpfs = argv + i + 1;
    if ((i = count(i, argc, argv, 2, &s->ntmpfs)) < 0) return -1;
    s->rlimits = argv + i + 1;
    if ((i = count(i, argc, argv, 2, &s->nrlimits)) < 0) return -1;
    if (i + 1 >= argc || !same(argv[i + 1], "--")) return -1;
    s->filter = argv[i];
    s->argv = argv + i + 2; /* a run's program; none for a server */
    return 0;
}

/* The program's process: its rlimits, its directory, the slot's uid, the syscall filter; exec.
 * (The raw setuid family changes this thread only: the helper has no other.) */
static void run_program(const struct spec *s, struct sock_filter *filter, unsigned short len, char **envp) {
    for (int i = 0; i < s->nrlimits; i++) {
        u64 v = number(s->rlimits[2 * i + 1]), limit[2] = {v, v};
        check(sys(__NR_prlimit64, 0, integer(s->rlimits[2 * i]), limit, 0), "setrlimit");
    }
    char what[300] = "chdir ";
    for (size_t i = 0, n = 6; s->cwd[i] && n < sizeof what - 1; i++) what[n++] = s->cwd[i];
    check(sys(__NR_chdir, s->cwd), what);
    if (s->uid >= 0) {
        check(sys(__NR_setgroups, 0, 0), "setgroups");
        check(sys(__NR_setgid, s->uid), "setgid");
        check(sys(__NR_setuid, s->uid), "setuid");
    }
    check(sys(__NR_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs");
    if (len) {
        struct sock_fprog prog = {len, filter};
        check(sys(__NR_prctl, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0), "seccomp");
    }
    fail("exec", sys(__NR_execve, s->argv[0], s->argv, envp));
}

static long fork_(void) {
    return check(sys(__NR_clone, SIGCHLD, 0, 0, 0, 0), "fork");
}

static struct sock_filter FILTER[BPF_MAXINSNS];

/* The spawner's checks of a run's or a server's first process: the set-up pipe closed on exec,
 * killed with the pool's thread, its arguments and the syscall filter's instructions. */
static unsigned short begin(int argc, char **argv, struct spec *s) {
    long parent = sys(__NR_getppid);
    if (sys(__NR_fcntl, SETUP_FD, F_SETFD, FD_CLOEXEC) != 0) leave(SETUP_FAILED);
    check(sys(__NR_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "pdeathsig"); /* the pool's thread gone: so is the run */
    if (sys(__NR_getppid) != parent) leave(SETUP_FAILED);
    if (parse(argc, argv, s) != 0) fail("the helper's arguments", -22);
    return parse_filter(s->filter, FILTER);
}

/* Into the slot: its cgroups (their limits hold over all it forks), first to die when out of
 * memory, its namespaces; the spawner's other fds closed. */
static void enter_slot(const struct spec *s) {
    char pid[24];
    const char *self = decimal((u64)sys(__NR_getpid), pid + sizeof pid);
    for (int i = 0; i < s->ncgroups; i++) write_fd(CGROUPS_FD + i, self, "join the slot's cgroup");
    write_file("/proc/self/oom_score_adj", "1000");
    if (s->namespaces) {
        check(sys(__NR_setns, NETNS_FD, CLONE_NEWNET), "setns (the slot's network namespace)");
        check(sys(__NR_setns, MNTNS_FD, CLONE_NEWNS), "setns (the slot's mount namespace)");
        check(sys(__NR_chdir, "/"), "chdir /");
    }
    check(sys(__NR_close_range, SETUP_FD + 1, ~0U, 0), "close the spawner's fds");
}

static void mount_tmpfs(const struct spec *s, int i) {
    check(sys(__NR_mount, "tmpfs", s->tmpfs[2 * i], "tmpfs", MS_NOSUID | MS_NODEV, s->tmpfs[2 * i + 1]), s->tmpfs[2 * i]);
}

/* pid 1 of a new pid and mount namespace (the caller waits for it and exits as it does), with
 * the runs' own tmpfs and /proc. */
static void new_namespaces(const struct spec *s) {
    check(sys(__NR_unshare, CLONE_NEWNS | CLONE_NEWPID), "unshare");
    long child = fork_();
    if (child > 0) {
        sys(__NR_close, CONTROL_FD);
        exit_as(child);
    }
    check(sys(__NR_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "pdeathsig");
    for (int i = 0; i < s->ntmpfs; i++) mount_tmpfs(s, i);
    check(sys(__NR_mount, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, 0), "mount /proc");
}

/* One run without namespaces (with them, the slot's server runs it). */
static void start(int argc, char **argv, char **envp) {
    struct spec s;
    unsigned short len = begin(argc, argv, &s);
    if (s.namespaces || !s.argv[0]) fail("the helper's arguments", -22);
    enter_slot(&s);
    long child = fork_();
    if (child > 0) exit_as(child);
    run_program(&s, FILTER, len, envp);
}

/* ---- a slot's server ---------------------------------------------------------------------- */

enum { MAX_TMPFS = 8, MAX_WORDS = 1024, REQUEST_BYTES = 1 << 16, MAX_FDS = 6 };

/* What a run may have changed in one of the namespace's tmpfs: its use, its root's mode, owner,
 * links, flags (chattr), times and extended attributes. The kernel sets a ctime on every change,
 * but before Linux 6.13 at a clock tick's granularity, so the counts and the rest are compared too. */
struct fs_state {
    u64 blocks_free, files_free, attributes;
    unsigned mode, uid, gid, nlink;
    struct statx_timestamp atime, mtime, ctime;
    long xattr_bytes;
};

static void fs_state(const char *path, struct fs_state *st) {
    struct statfs f;
    struct statx x;
    memset(st, 0, sizeof *st);
    check(sys(__NR_statfs, path, &f), path);
    check(sys(__NR_statx, AT_FDCWD, path, AT_SYMLINK_NOFOLLOW, STATX_BASIC_STATS, &x), path);
    st->blocks_free = f.f_bfree, st->files_free = f.f_ffree, st->attributes = x.stx_attributes;
    st->mode = x.stx_mode, st->uid = x.stx_uid, st->gid = x.stx_gid, st->nlink = x.stx_nlink;
    st->atime = x.stx_atime, st->mtime = x.stx_mtime, st->ctime = x.stx_ctime;
    st->xattr_bytes = sys(__NR_llistxattr, path, 0, 0);
}

static int changed(const struct fs_state *a, const struct fs_state *b) {
    const unsigned char *x = (const unsigned char *)a, *y = (const unsigned char *)b;
    for (size_t i = 0; i < sizeof *a; i++) {
        if (x[i] != y[i]) return 1;
    }
    return 0;
}

static struct fs_state FRESH[MAX_TMPFS];

/* Every tmpfs mounted afresh, in their order, if a run changed any (the old ones go with their
 * last users, all killed): which one it changed, or its mounts' order, tells the next run nothing. */
static void renew_tmpfs(const struct spec *s) {
    int any = 0;
    for (int i = 0; i < s->ntmpfs && !any; i++) {
        struct fs_state now;
        fs_state(s->tmpfs[2 * i], &now);
        any = changed(&now, &FRESH[i]);
    }
    for (int i = 0; any && i < s->ntmpfs; i++) check(sys(__NR_umount2, s->tmpfs[2 * i], MNT_DETACH), s->tmpfs[2 * i]);
    for (int i = 0; any && i < s->ntmpfs; i++) {
        mount_tmpfs(s, i);
        fs_state(s->tmpfs[2 * i], &FRESH[i]);
    }
}

/* Unix sockets of the slot's network namespace (its processes all gone: the ones a run left in
 * flight), from the lines of /proc/net/unix after its header. */
static long unix_sockets(void) {
    static char buf[4096];
    long fd = sys(__NR_openat, AT_FDCWD, "/proc/net/unix", O_RDONLY | O_CLOEXEC), n, lines = 0;
    if (fd < 0) return 0;
    while ((n = sys(__NR_read, fd, buf, sizeof buf)) > 0) {
        for (long i = 0; i < n; i++) lines += buf[i] == '\n';
    }
    sys(__NR_close, fd);
    return lines > 0 ? lines - 1 : 0;
}

/* Sockets a run sent over a unix socket that no process holds (fds in flight) outlive its
 * processes: the files they hold, charged to the slot's memory, and the names they bound stay
 * for the next run to meet, until the kernel collects them, which closing a unix socket starts.
 * Started, and waited for (at most ~0.5 s). */
static void collect_sockets(void) {
    for (int i = 0; i < 250 && unix_sockets() > 0; i++) {
        int pair[2];
        if (sys(__NR_socketpair, 1 /* AF_UNIX */, 1 /* SOCK_STREAM */ | O_CLOEXEC, 0, pair) == 0) {
            sys(__NR_close, pair[0]);
            sys(__NR_close, pair[1]);
        }
        long pause[2] = {0, 2000000};
        sys(__NR_clock_nanosleep, 1 /* CLOCK_MONOTONIC */, 0, pause, 0);
    }
}

/* A run's SysV objects (shared memory, message queues, semaphores) outlive its processes: its
 * IPC namespace is freed some ms after the last of them ends (a workqueue, after an RCU grace
 * period), and until then a segment's pages stay charged to the slot's memory, where the next
 * run (another episode) would run out of memory at a use its limit allows. Nothing is attached
 * once every process is gone, so removing them frees their memory now. */
static void remove_kind(const char *file, long nr, int sem) {
    static char buf[65536];
    for (int pass = 0; pass < 1000; pass++) { /* a pass removes the objects its read holds whole */
        long fd = sys(__NR_openat, AT_FDCWD, file, O_RDONLY | O_CLOEXEC), n = 0, got, found = 0;
        if (fd < 0) return;
        while (n < (long)sizeof buf - 1 && (got = sys(__NR_read, fd, buf + n, sizeof buf - 1 - n)) > 0) n += got;
        sys(__NR_close, fd);
        long i = 0;
        while (i < n && buf[i] != '\n') i++; /* the header */
        for (;;) {
            long end = ++i;
            while (end < n && buf[end] != '\n') end++;
            if (end >= n) break; /* no whole line left */
            buf[end] = 0;
            char *p = buf + i;
            while (*p == ' ') p++;
            while (*p && *p != ' ') p++; /* the key */
            while (*p == ' ') p++;
            long id = integer(p);
            if (sem) sys(nr, id, 0, IPC_RMID); /* semctl(id, semnum, cmd) */
            else sys(nr, id, IPC_RMID, 0);
            found++;
            i = end;
        }
        if (!found) return;
    }
}

static void remove_sysv(void) {
    remove_kind("/proc/sysvipc/shm", __NR_shmctl, 0);
    remove_kind("/proc/sysvipc/msg", __NR_msgctl, 0);
    remove_kind("/proc/sysvipc/sem", __NR_semctl, 1);
}

struct iovec_ {
    void *base;
    size_t len;
};
struct msghdr_ {
    void *name;
    int namelen;
    struct iovec_ *iov;
    size_t iovlen;
    void *control;
    size_t controllen;
    int flags;
};
struct fds_message {
    size_t len;
    int level, type;
    int fds[MAX_FDS];
};

static char REQUEST[REQUEST_BYTES + 1];
static char *WORDS[MAX_WORDS + 1];

/* The next request: its words (NUL-separated) and the run's fds (its 0-3 or 0-4, then its set-up
 * pipe); their number in `nfds`. 0: the pool closed the socket. */
static int receive(int fds[MAX_FDS], int *nfds) {
    struct iovec_ iov = {REQUEST, REQUEST_BYTES};
    struct fds_message cm;
    struct msghdr_ m = {0, 0, &iov, 1, &cm, sizeof cm, 0};
    memset(&cm, 0, sizeof cm);
    long n;
    while ((n = sys(__NR_recvmsg, CONTROL_FD, &m, MSG_CMSG_CLOEXEC)) == -4) {
    }
    if (n <= 0) return 0;
    int got = m.controllen >= sizeof(size_t) + 2 * sizeof(int) && cm.level == SOL_SOCKET && cm.type == SCM_RIGHTS
                  ? (int)((cm.len - sizeof(size_t) - 2 * sizeof(int)) / sizeof(int))
                  : 0;
    if (got < MAX_FDS - 1 || got > MAX_FDS || (m.flags & MSG_CTRUNC) || REQUEST[n - 1] != 0) leave(SETUP_FAILED); /* not the pool's */
    for (int i = 0; i < got; i++) fds[i] = cm.fds[i];
    *nfds = got;
    int w = 0;
    for (long i = 0; i < n && w < MAX_WORDS; w++) {
        WORDS[w] = REQUEST + i;
        i += (long)length(REQUEST + i) + 1;
    }
    WORDS[w] = 0;
    return w;
}

/* A run's process: its fds at 0-3 or 0-4 and its set-up pipe at 5 (moved above them first, so
 * none overwrites another), then the program as a run of the helper's starts it. */
static void __attribute__((noreturn)) serve_program(struct spec *s, int words, int fds[MAX_FDS], int nfds, unsigned short len, char **envp) {
    int high[MAX_FDS];
    for (int i = 0; i < nfds; i++) high[i] = (int)sys(__NR_fcntl, fds[i], F_DUPFD_CLOEXEC, 16);
    for (int i = 0; i < nfds; i++) { /* the set-up pipe closed on exec: the program never writes to it */
        int target = i == nfds - 1 ? SETUP_FD : i;
        if (high[i] < 0 || sys(__NR_dup3, high[i], target, target == SETUP_FD ? O_CLOEXEC : 0) < 0) leave(SETUP_FAILED);
    }
    if (nfds < MAX_FDS) sys(__NR_close, MAX_FDS - 2);
    sys(__NR_close_range, SETUP_FD + 1, ~0U, 0);
    int n = words > 1 ? (int)integer(WORDS[1]) : -1;
    if (n < 0 || 2 + 2 * n >= words) fail("the request", -22);
    s->cwd = WORDS[0], s->nrlimits = n, s->rlimits = WORDS + 2, s->argv = WORDS + 2 + 2 * n;
    run_program(s, FILTER, len, envp);
    leave(SETUP_FAILED);
}

/* One run: the program as pid 2, as in a namespace of its own; then every process it left
 * killed and reaped, its tmpfs renewed; its exit code to the pool. */
static void serve_one(struct spec *s, unsigned short len, char **envp) {
    int fds[MAX_FDS], nfds = 0;
    int words = receive(fds, &nfds);
    if (words == 0) leave(0);
    long last = sys(__NR_openat, AT_FDCWD, "/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
    if (last >= 0) { /* the run's pids from 2 again, as in a namespace of its own (they tell nothing of the last run) */
        sys(__NR_write, last, "1", 1);
        sys(__NR_close, last);
    }
    /* The run's own SysV IPC namespace, which this server enters with it: after the run it
     * removes what the run left there (remove_sysv), which only a process inside can. */
    check(sys(__NR_unshare, CLONE_NEWIPC), "unshare (SysV IPC)");
    long child = sys(__NR_clone, SIGCHLD, 0, 0, 0, 0);
    if (child == 0) serve_program(s, words, fds, nfds, len, envp);
    int code = child > 0 ? 0 : tell(fds[nfds - 1], "fork", child); /* this run's set-up failed; the server serves on */
    for (int i = 0; i < nfds; i++) sys(__NR_close, fds[i]);
    if (child > 0) code = wait_code(child);
    sys(__NR_kill, -1, SIGKILL); /* from pid 1: every other process of the namespace */
    long r;
    while ((r = sys(__NR_wait4, -1, 0, __WALL, 0)) != -10) { /* until ECHILD */
        if (r < 0 && r != -4) leave(SETUP_FAILED);
    }
    remove_sysv();
    collect_sockets();
    renew_tmpfs(s);
    check(sys(__NR_write, CONTROL_FD, &code, sizeof code), "answer the pool");
}

static void serve(int argc, char **argv, char **envp) {
    struct spec s;
    unsigned short len = begin(argc, argv, &s);
    if (!s.namespaces || s.ntmpfs > MAX_TMPFS) fail("the server's arguments", -22);
    enter_slot(&s);
    new_namespaces(&s);
    for (int i = 0; i < s.ntmpfs; i++) fs_state(s.tmpfs[2 * i], &FRESH[i]);
    check(sys(__NR_write, CONTROL_FD, "R", 1), "tell the pool");
    /* Each run brings its own set-up pipe; fds 0-5 stay taken (/dev/null), so none of a run's
     * received fds is numbered 5, where a failure of pid 1 itself would write. */
    if (sys(__NR_dup3, 0, SETUP_FD, O_CLOEXEC) < 0 || sys(__NR_dup3, 0, 4, O_CLOEXEC) < 0) leave(SETUP_FAILED);
    for (;;) serve_one(&s, len, envp);
}

/* The process's entry: argc, argv and the environment from the stack the kernel set up. */
void __attribute__((noreturn, used)) entry(long *stack) {
    int argc = (int)stack[0];
    char **argv = (char **)(stack + 1);
    if (argc > 1 && same(argv[1], "serve")) {
        serve(argc - 1, argv + 1, argv + argc + 1);
    } else {
        start(argc, argv, argv + argc + 1);
    }
    leave(SETUP_FAILED);
}

#if defined(__x86_64__)
__asm__(".globl _start\n_start:\n xor %rbp, %rbp\n mov %rsp, %rdi\n and $-16, %rsp\n call entry\n");
#else
__asm__(".globl _start\n_start:\n mov x29, #0\n mov x0, sp\n bl entry\n");
#endif
