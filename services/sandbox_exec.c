/* The sandbox's exec path: one run of a program the sandbox execs (bash, a binary), set up as
 * services/sandbox_launcher.py's run() sets up a forked one, in three small processes instead
 * of three copies of the launcher's interpreter. Forking a Python process, its children's page
 * faults and their exits were ~80% of such a run's cost; this is the launcher's thinnest
 * replacement for them (the sandbox compiles it on start, with the host's C compiler).
 * It is freestanding (raw system calls, no C library): a static libc's start-up (its CPU
 * feature probes trap to the hypervisor in a VM) and its pages' faults in each of the three
 * processes cost as much again as the rest of the helper.
 *
 *   sandbox_exec SPEC... -- PROGRAM ARGS...   (spawned by the sandbox's pool, its session leader)
 *   fds: 0-4 the run's stdin, stdout, stderr, report, tests; 5 the set-up pipe (why the sandbox
 *   could not be set up; closed before the program runs); 6 and 7 the slot's network and mount
 *   namespaces (namespaces only); from 8, NCGROUPS cgroup.procs files to join. SPEC, in order:
 *     NAMESPACES(0|1) UID(-1: keep) CWD NCGROUPS NTMPFS (TARGET OPTIONS)...
 *     NRLIMITS (RESOURCE VALUE)... FILTER(hex, or -)
 * Exits with the program's code, 128 + the signal that ended it, or 125 if set-up failed.
 */
#include <asm/unistd.h>
#include <linux/fcntl.h>
#include <linux/filter.h>
#include <linux/prctl.h>
#include <linux/sched.h>
#include <linux/seccomp.h>
#include <linux/signal.h>
#include <linux/wait.h>

#if !defined(__x86_64__) && !defined(__aarch64__)
#error "sandbox_exec.c: system calls for x86_64 and aarch64 only (elsewhere the launcher forks)"
#endif

#define MS_NOSUID 2
#define MS_NODEV 4
#define MS_NOEXEC 8
#define BPF_MAXINSNS 4096

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
enum { SETUP_FD = 5, NETNS_FD = 6, MNTNS_FD = 7, CGROUPS_FD = 8, SETUP_FAILED = 125 };

/* The names of the errors a set-up step may meet; others by number. */
static const char *const ERRORS[] = {
    [1] = "Operation not permitted", [2] = "No such file or directory", [4] = "Interrupted system call",
    [9] = "Bad file descriptor",     [11] = "Resource temporarily unavailable", [12] = "Cannot allocate memory",
    [13] = "Permission denied",      [16] = "Device or resource busy", [17] = "File exists",
    [20] = "Not a directory",        [22] = "Invalid argument", [24] = "Too many open files",
    [28] = "No space left on device", [36] = "File name too long", [38] = "Function not implemented",
};

/* "OSError: WHAT: WHY" to the set-up pipe, and exit 125. `err`: the failed call's (negative) return. */
static void __attribute__((noreturn)) fail(const char *what, long err) {
    char msg[512], num[24];
    size_t n = 0;
    const char *why = -err > 0 && -err < (long)(sizeof ERRORS / sizeof *ERRORS) ? ERRORS[-err] : 0;
    const char *parts[] = {"OSError: ", what, ": ", why ? why : "error ", why ? "" : decimal((u64)-err, num + 24)};
    for (size_t p = 0; p < sizeof parts / sizeof *parts; p++) {
        for (const char *c = parts[p]; *c && n < sizeof msg; c++) msg[n++] = *c;
    }
    sys(__NR_write, SETUP_FD, msg, n); /* nothing left to tell it with if this fails */
    leave(SETUP_FAILED);
}

static long check(long result, const char *what) {
    if (result < 0) fail(what, result);
    return result;
}

/* Wait for `pid`; exit as it did (a shell's code for a signal). The set-up pipe is closed first:
 * only the program's process, before it execs, may still write to it. */
static void __attribute__((noreturn)) exit_as(long pid) {
    int status = 0;
    sys(__NR_close, SETUP_FD);
    long r;
    while ((r = sys(__NR_wait4, pid, &status, 0, 0)) < 0) {
        if (r != -4) leave(SETUP_FAILED); /* but EINTR */
    }
    int signal = status & 0x7f;
    leave(signal ? 128 + signal : (status >> 8) & 0xff);
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
    if (i + 2 >= argc || !same(argv[i + 1], "--")) return -1;
    s->filter = argv[i];
    s->argv = argv + i + 2;
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

static void start(int argc, char **argv, char **envp) {
    struct spec s;
    long parent = sys(__NR_getppid);
    if (sys(__NR_fcntl, SETUP_FD, F_SETFD, FD_CLOEXEC) != 0) leave(SETUP_FAILED);
    check(sys(__NR_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "pdeathsig"); /* the pool's thread gone: so is the run */
    if (sys(__NR_getppid) != parent) leave(SETUP_FAILED);
    if (parse(argc, argv, &s) != 0) fail("the helper's arguments", -22);
    unsigned short len = parse_filter(s.filter, FILTER);
    char pid[24];
    const char *self = decimal((u64)sys(__NR_getpid), pid + sizeof pid);
    for (int i = 0; i < s.ncgroups; i++) write_fd(CGROUPS_FD + i, self, "join the slot's cgroup"); /* its limits hold over all it forks */
    write_file("/proc/self/oom_score_adj", "1000");                     /* out of memory, the run dies first */
    if (s.namespaces) {
        check(sys(__NR_setns, NETNS_FD, CLONE_NEWNET), "setns (the slot's network namespace)");
        check(sys(__NR_setns, MNTNS_FD, CLONE_NEWNS), "setns (the slot's mount namespace)");
        check(sys(__NR_chdir, "/"), "chdir /");
    }
    check(sys(__NR_close_range, SETUP_FD + 1, ~0U, 0), "close the spawner's fds");
    if (s.namespaces) {
        check(sys(__NR_unshare, CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID), "unshare");
        long child = fork_();
        if (child > 0) exit_as(child);
        /* pid 1 of the run's namespace: its own tmpfs and /proc, then the program as its child */
        check(sys(__NR_prctl, PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "pdeathsig");
        for (int i = 0; i < s.ntmpfs; i++) {
            check(sys(__NR_mount, "tmpfs", s.tmpfs[2 * i], "tmpfs", MS_NOSUID | MS_NODEV, s.tmpfs[2 * i + 1]),
                  s.tmpfs[2 * i]);
        }
        check(sys(__NR_mount, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, 0), "mount /proc");
    }
    long child = fork_();
    if (child > 0) exit_as(child);
    run_program(&s, FILTER, len, envp);
}

/* The process's entry: argc, argv and the environment from the stack the kernel set up. */
void __attribute__((noreturn, used)) entry(long *stack) {
    int argc = (int)stack[0];
    char **argv = (char **)(stack + 1);
    start(argc, argv, argv + argc + 1);
    leave(SETUP_FAILED);
}

#if defined(__x86_64__)
__asm__(".globl _start\n_start:\n xor %rbp, %rbp\n mov %rsp, %rdi\n and $-16, %rsp\n call entry\n");
#else
__asm__(".globl _start\n_start:\n mov x29, #0\n mov x0, sp\n bl entry\n");
#endif
