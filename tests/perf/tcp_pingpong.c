/* Bare TCP ping-pong floor for the remote Engram benchmark (tests/perf/bench_remote_engram.py).
 *
 * Usage: tcp_pingpong REQ_BYTES REP_BYTES ITERS WARMUP
 *        tcp_pingpong -s REQ_BYTES REP_BYTES CLIENT_CPU SERVER_CPU
 * Forks a server on 127.0.0.1 (ephemeral port); the client sends REQ_BYTES, the server answers
 * REP_BYTES, blocking sockets, TCP_NODELAY.  The first form runs WARMUP + ITERS round trips and
 * prints one line per measured iteration: round trip in ns.  The second (-s, "stream") keeps the
 * pair alive and reads commands from stdin: a line with a count N runs N round trips and prints
 * their times (ns) on one line, so a benchmark can interleave short blocks of the floor with its
 * own arms; EOF ends it.  CLIENT_CPU / SERVER_CPU pin the two ends (-1: the scheduler decides).
 * This is the floor a request/response transport on the same loopback cannot beat.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int xfer(int fd, char *buf, size_t n, int sending) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = sending ? send(fd, buf + got, n - got, 0) : recv(fd, buf + got, n - got, 0);
        if (r <= 0) return -1;
        got += (size_t)r;
    }
    return 0;
}

static void pin(int cpu) {
    if (cpu < 0) return;
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    if (sched_setaffinity(0, sizeof s, &s)) perror("sched_setaffinity");
}

static long rtt(int fd, char *buf, size_t req, size_t rep) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (xfer(fd, buf, req, 1) || xfer(fd, buf, rep, 0)) return -1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec);
}

int main(int argc, char **argv) {
    int stream = argc == 6 && strcmp(argv[1], "-s") == 0;
    if (argc != 5 && !stream) {
        fprintf(stderr, "usage: %s REQ REP ITERS WARMUP | %s -s REQ REP CLIENT_CPU SERVER_CPU\n", argv[0], argv[0]);
        return 2;
    }
    char **a0 = argv + stream;
    size_t req = strtoul(a0[1], 0, 10), rep = strtoul(a0[2], 0, 10);
    long iters = stream ? 0 : atol(a0[3]), warm = stream ? 0 : atol(a0[4]);
    int ccpu = stream ? atoi(a0[3]) : -1, scpu = stream ? atoi(a0[4]) : -1;
    int one = 1;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK); a.sin_port = 0;
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1)) { perror("bind"); return 1; }
    socklen_t al = sizeof a; getsockname(ls, (struct sockaddr *)&a, &al);
    char *buf = malloc(req > rep ? req : rep); memset(buf, 7, req > rep ? req : rep);
    pid_t pid = fork();
    if (pid == 0) {
        pin(scpu);
        int fd = accept(ls, 0, 0);
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        while (xfer(fd, buf, req, 0) == 0 && xfer(fd, buf, rep, 1) == 0) {}
        _exit(0);
    }
    pin(ccpu);
    close(ls);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) { perror("connect"); return 1; }
    if (stream) {
        long n;
        while (scanf("%ld", &n) == 1) {
            for (long i = 0; i < n; i++) {
                long t = rtt(fd, buf, req, rep);
                if (t < 0) { fprintf(stderr, "io error\n"); return 1; }
                printf(i ? " %ld" : "%ld", t);
            }
            printf("\n");
            fflush(stdout);
        }
    } else {
        for (long i = 0; i < warm + iters; i++) {
            long t = rtt(fd, buf, req, rep);
            if (t < 0) { fprintf(stderr, "io error\n"); return 1; }
            if (i >= warm) printf("%ld\n", t);
        }
    }
    close(fd);
    waitpid(pid, 0, 0);
    return 0;
}
