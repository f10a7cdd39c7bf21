/* The sandbox's exec path: one run of a program the sandbox execs (bash, a binary), set up as
 * services/sandbox_launcher.py's run() sets up a forked one, in three small processes instead
 * of three copies of the launcher's interpreter. Forking a Python process, its children's page
 * faults and their exits were ~80% of such a run's cost; this is the launcher's thinnest
 * replacement for them (the sandbox compiles it on start, with the host's C compiler).
 *
 *   sandbox_exec SPEC... -- PROGRAM ARGS...   (spawned by the launcher, its session leader)
 *   fds: 0-4 the run's stdin, stdout, stderr, report, tests; 5 the set-up pipe (why the sandbox
 *   could not be set up; closed before the program runs); 6 and 7 the slot's network and mount
 *   namespaces (namespaces only). SPEC, in order:
 *     NAMESPACES(0|1) UID(-1: keep) CWD NCGROUPS PROCS... NTMPFS (TARGET OPTIONS)...
 *     NRLIMITS (RESOURCE VALUE)... FILTER(hex, or -)
 * Exits with the program's code, 128 + the signal that ended it, or 125 if set-up failed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

enum { SETUP_FD = 5, NETNS_FD = 6, MNTNS_FD = 7, SETUP_FAILED = 125 };

static void fail(const char *what) {
    char msg[512];
    int n = snprintf(msg, sizeof msg, "OSError: %s: %s", what, strerror(errno));
    if (write(SETUP_FD, msg, n > 0 && n < (int)sizeof msg ? n : (int)sizeof msg - 1) < 0) {
        /* nothing left to tell it with */
    }
    _exit(SETUP_FAILED);
}

static void check(int result, const char *what) {
    if (result != 0) fail(what);
}

/* Wait for `pid`; exit as it did (a shell's code for a signal). The set-up pipe is closed first:
 * only the program's process, before it execs, may still write to it. */
static void exit_as(pid_t pid) {
    int status;
    close(SETUP_FD);
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) _exit(SETUP_FAILED);
    }
    _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail(path);
    if (write(fd, text, strlen(text)) < 0) fail(path);
    close(fd);
}

static int hexval(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* The syscall filter's instructions from hex (sandbox_seccomp.py's bytes); NULL for "-". */
static struct sock_filter *parse_filter(const char *hex, unsigned short *len) {
    size_t n = strlen(hex) / 2;
    if (strcmp(hex, "-") == 0) return NULL;
    if (n == 0 || n % sizeof(struct sock_filter) || n / sizeof(struct sock_filter) > BPF_MAXINSNS) {
        errno = EINVAL;
        fail("the syscall filter");
    }
    unsigned char *bytes = malloc(n);
    if (bytes == NULL) fail("the syscall filter");
    for (size_t i = 0; i < n; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            errno = EINVAL;
            fail("the syscall filter");
        }
        bytes[i] = (unsigned char)(hi << 4 | lo);
    }
    *len = (unsigned short)(n / sizeof(struct sock_filter));
    return (struct sock_filter *)bytes;
}

struct spec {
    int namespaces;
    long uid;
    const char *cwd;
    int ncgroups, ntmpfs, nrlimits;
    char **cgroups, **tmpfs, **rlimits;
    const char *filter;
    char **argv;
};

static int count(int i, int argc, char **argv, int per, int *n) {
    if (i >= argc) return -1;
    *n = atoi(argv[i]);
    return *n < 0 || i + 1 + *n * per > argc ? -1 : i + 1 + *n * per;
}

static int parse(int argc, char **argv, struct spec *s) {
    int i = 1;
    if (argc < 5) return -1;
    s->namespaces = atoi(argv[i++]);
    s->uid = atol(argv[i++]);
    s->cwd = argv[i++];
    s->cgroups = argv + i + 1;
    if ((i = count(i, argc, argv, 1, &s->ncgroups)) < 0) return -1;
    s->tmpfs = argv + i + 1;
    if ((i = count(i, argc, argv, 2, &s->ntmpfs)) < 0) return -1;
    s->rlimits = argv + i + 1;
    if ((i = count(i, argc, argv, 2, &s->nrlimits)) < 0) return -1;
    if (i + 2 >= argc || strcmp(argv[i + 1], "--") != 0) return -1;
    s->filter = argv[i];
    s->argv = argv + i + 2;
    return 0;
}

/* The program's process: its rlimits, its directory, the slot's uid, the syscall filter; exec. */
static void run_program(const struct spec *s, struct sock_filter *filter, unsigned short len) {
    for (int i = 0; i < s->nrlimits; i++) {
        rlim_t v = (rlim_t)strtoull(s->rlimits[2 * i + 1], NULL, 10);
        struct rlimit r = {v, v};
        check(setrlimit(atoi(s->rlimits[2 * i]), &r), "setrlimit");
    }
    char what[300];
    snprintf(what, sizeof what, "chdir %s", s->cwd);
    check(chdir(s->cwd), what);
    if (s->uid >= 0) {
        check(setgroups(0, NULL), "setgroups");
        check(setgid((gid_t)s->uid), "setgid");
        check(setuid((uid_t)s->uid), "setuid");
    }
    check(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs");
    if (filter != NULL) {
        struct sock_fprog prog = {len, filter};
        check(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0), "seccomp");
    }
    execve(s->argv[0], s->argv, environ);
    fail("exec");
}

int main(int argc, char **argv) {
    struct spec s;
    pid_t parent = getppid();
    if (fcntl(SETUP_FD, F_SETFD, FD_CLOEXEC) != 0) _exit(SETUP_FAILED);
    check(prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "pdeathsig"); /* the launcher gone: so is the run */
    if (getppid() != parent) _exit(SETUP_FAILED);
    if (parse(argc, argv, &s) != 0) {
        errno = EINVAL;
        fail("the launcher's arguments");
    }
    unsigned short len = 0;
    struct sock_filter *filter = parse_filter(s.filter, &len);
    char pid[24];
    snprintf(pid, sizeof pid, "%d", getpid());
    for (int i = 0; i < s.ncgroups; i++) write_file(s.cgroups[i], pid); /* the slot's limits hold over all it forks */
    write_file("/proc/self/oom_score_adj", "1000");                    /* out of memory, the run dies first */
    if (s.namespaces) {
        check(setns(NETNS_FD, CLONE_NEWNET), "setns (the slot's network namespace)");
        check(setns(MNTNS_FD, CLONE_NEWNS), "setns (the slot's mount namespace)");
        check(chdir("/"), "chdir /");
    }
    check(syscall(SYS_close_range, SETUP_FD + 1, ~0U, 0), "close the launcher's fds");
    if (s.namespaces) {
        check(unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWPID), "unshare");
        pid_t child = fork();
        if (child < 0) fail("fork");
        if (child > 0) exit_as(child);
        /* pid 1 of the run's namespace: its own tmpfs and /proc, then the program as its child */
        check(prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "pdeathsig");
        for (int i = 0; i < s.ntmpfs; i++) {
            check(mount("tmpfs", s.tmpfs[2 * i], "tmpfs", MS_NOSUID | MS_NODEV, s.tmpfs[2 * i + 1]), s.tmpfs[2 * i]);
        }
        check(mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL), "mount /proc");
    }
    pid_t child = fork();
    if (child < 0) fail("fork");
    if (child > 0) exit_as(child);
    run_program(&s, filter, len);
    return SETUP_FAILED;
}
