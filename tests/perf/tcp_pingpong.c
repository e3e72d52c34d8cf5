/* Bare TCP ping-pong floor for the remote Engram benchmark (tests/perf/bench_remote_tcp.py).
 *
 * Usage: tcp_pingpong REQ_BYTES REP_BYTES ITERS WARMUP
 * Forks a server on 127.0.0.1 (ephemeral port); the client sends REQ_BYTES, the server answers
 * REP_BYTES, blocking sockets, TCP_NODELAY.  Prints one line per iteration: round trip in ns.
 * This is the floor a request/response transport on the same loopback cannot beat.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: %s REQ REP ITERS WARMUP\n", argv[0]); return 2; }
    size_t req = strtoul(argv[1], 0, 10), rep = strtoul(argv[2], 0, 10);
    long iters = atol(argv[3]), warm = atol(argv[4]);
    int one = 1;
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(INADDR_LOOPBACK); a.sin_port = 0;
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1)) { perror("bind"); return 1; }
    socklen_t al = sizeof a; getsockname(ls, (struct sockaddr *)&a, &al);
    char *buf = malloc(req > rep ? req : rep); memset(buf, 7, req > rep ? req : rep);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = accept(ls, 0, 0);
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        while (xfer(fd, buf, req, 0) == 0 && xfer(fd, buf, rep, 1) == 0) {}
        _exit(0);
    }
    close(ls);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) { perror("connect"); return 1; }
    for (long i = 0; i < warm + iters; i++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        if (xfer(fd, buf, req, 1) || xfer(fd, buf, rep, 0)) { fprintf(stderr, "io error\n"); return 1; }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (i >= warm) printf("%ld\n", (t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec));
    }
    close(fd);
    waitpid(pid, 0, 0);
    return 0;
}
