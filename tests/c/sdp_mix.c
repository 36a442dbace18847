/* A socket program written for the SDP preload's test: it mixes sockets the switch puts
 * on SDP (port A) and on TCP (port B, by the policy), dups them, forks, execs, and waits
 * for them with poll, select and epoll in the same loop; every message is checked. Fork
 * children and exec'd programs use inherited sockets of both kinds, and the parent keeps
 * using them after.
 *
 *   sdp_mix ADDR PORT_A PORT_B   the test (listens on every address, connects to ADDR)
 *   sdp_mix --exec-child FD      (run by the test itself after exec) write on FD, exit
 *
 * Ends by printing its SDP report (the preload's @krdma-sdp.<pid> socket) and "OK".
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { fprintf(stderr, "FAIL %s:%d: %s (errno %d %s)\n", __FILE__, __LINE__, #c, errno, strerror(errno)); exit(1); } } while (0)

static int listener(int port) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(l >= 0);
    int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_ANY)};
    CHECK(bind(l, (struct sockaddr *)&a, sizeof a) == 0);
    CHECK(listen(l, 16) == 0);
    return l;
}

static const char *peer_addr = "127.0.0.1";

static int connect_to(int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(s >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    CHECK(inet_pton(AF_INET, peer_addr, &a.sin_addr) == 1);
    CHECK(connect(s, (struct sockaddr *)&a, sizeof a) == 0);
    return s;
}

static void write_all(int fd, const void *b, size_t n) {
    const char *p = b;
    while (n) {
        ssize_t w = write(fd, p, n);
        CHECK(w > 0);
        p += w;
        n -= w;
    }
}

static void read_all(int fd, void *b, size_t n) {
    char *p = b;
    while (n) {
        ssize_t r = read(fd, p, n);
        CHECK(r > 0);
        p += r;
        n -= r;
    }
}

/* Wait until `fd` is readable, asking poll, select and epoll in turn. */
static void wait_readable(int fd, int round, int ep) {
    if (round % 3 == 0) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        CHECK(poll(&p, 1, 10000) == 1 && (p.revents & POLLIN));
    } else if (round % 3 == 1) {
        fd_set r;
        FD_ZERO(&r);
        FD_SET(fd, &r);
        struct timeval tv = {.tv_sec = 10};
        CHECK(select(fd + 1, &r, NULL, NULL, &tv) == 1 && FD_ISSET(fd, &r));
    } else {
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = fd}, out[8];
        CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0);
        int n, seen = 0;
        do {
            n = epoll_wait(ep, out, 8, 10000);
            CHECK(n > 0);
            for (int i = 0; i < n; i++)
                seen |= out[i].data.fd == fd;
        } while (!seen);
        CHECK(epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL) == 0);
    }
}

/* One round trip from `a` to `b` and back, sized and patterned by `round`. */
static void exchange(int a, int b, int round, int ep) {
    size_t n = 1 + (round * 7919) % 300000;
    char *out = calloc(n, 1), *in = calloc(n, 1);
    CHECK(out && in);
    for (size_t i = 0; i < n; i++)
        out[i] = (char)(i * 31 + round);
    write_all(a, out, n);
    wait_readable(b, round, ep);
    read_all(b, in, n);
    CHECK(memcmp(in, out, n) == 0);
    write_all(b, in, n);
    wait_readable(a, round + 1, ep);
    read_all(a, out, n);
    CHECK(memcmp(in, out, n) == 0);
    free(out);
    free(in);
}

static void print_report(void) {
    int u = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int len = snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "krdma-sdp.%d", getpid());
    if (connect(u, (struct sockaddr *)&a, offsetof(struct sockaddr_un, sun_path) + 1 + len) == 0) {
        char buf[8192];
        ssize_t r;
        while ((r = read(u, buf, sizeof buf)) > 0)
            fwrite(buf, 1, r, stdout);
    }
    close(u);
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--exec-child") == 0) {
        int fd = atoi(argv[2]);
        write_all(fd, "exec", 4);
        return 0;
    }
    CHECK(argc == 4);
    peer_addr = argv[1];
    int pa = atoi(argv[2]), pb = atoi(argv[3]);
    int la = listener(pa), lb = listener(pb);
    int ca = connect_to(pa), cb = connect_to(pb);
    int sa = accept(la, NULL, NULL), sb = accept(lb, NULL, NULL);
    CHECK(sa >= 0 && sb >= 0);
    int ep = epoll_create1(0);
    CHECK(ep >= 0);

    /* Plain traffic on both kinds, every waiting call on each. */
    for (int r = 0; r < 6; r++) {
        exchange(ca, sa, r, ep);
        exchange(cb, sb, r, ep);
    }

    /* dup: the copies work, the originals closed. */
    int ca2 = dup(ca), sb2 = dup2(sb, 100);
    CHECK(ca2 >= 0 && sb2 == 100);
    close(ca);
    close(sb);
    for (int r = 6; r < 9; r++) {
        exchange(ca2, sa, r, ep);
        exchange(cb, sb2, r, ep);
    }

    /* Both kinds at once in one epoll set and one poll array. */
    write_all(ca2, "x", 1);
    write_all(cb, "y", 1);
    struct epoll_event e1 = {.events = EPOLLIN, .data.fd = sa}, e2 = {.events = EPOLLIN, .data.fd = sb2}, out[4];
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, sa, &e1) == 0 && epoll_ctl(ep, EPOLL_CTL_ADD, sb2, &e2) == 0);
    int got = 0;
    while (got != 3) {
        int n = epoll_wait(ep, out, 4, 10000);
        CHECK(n > 0);
        for (int i = 0; i < n; i++)
            got |= out[i].data.fd == sa ? 1 : 2;
    }
    struct pollfd pf[2] = {{.fd = sa, .events = POLLIN}, {.fd = sb2, .events = POLLIN}};
    CHECK(poll(pf, 2, 10000) == 2);
    char c;
    read_all(sa, &c, 1);
    CHECK(c == 'x');
    read_all(sb2, &c, 1);
    CHECK(c == 'y');
    epoll_ctl(ep, EPOLL_CTL_DEL, sa, NULL);
    epoll_ctl(ep, EPOLL_CTL_DEL, sb2, NULL);

    /* fork: the child closes its copies of everything and uses an inherited TCP
     * socket; the parent's sockets, SDP and TCP, keep working (SDP ones relayed from
     * here on). */
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        write_all(cb, "fork", 4);
        close(ca2);
        close(sa);
        close(sb2);
        close(cb);
        _exit(0);
    }
    int st;
    CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    char four[5] = {0};
    read_all(sb2, four, 4);
    CHECK(strcmp(four, "fork") == 0);
    for (int r = 9; r < 12; r++) {
        exchange(ca2, sa, r, ep);
        exchange(cb, sb2, r, ep);
    }

    /* fork: the child uses inherited sockets of both kinds, both ways, with every
     * waiting call (its own epoll set), while the parent waits; then the parent goes on
     * with them. */
    child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        int ep2 = epoll_create1(0);
        CHECK(ep2 >= 0);
        for (int r = 100; r < 104; r++) {
            exchange(ca2, sa, r, ep2);
            exchange(cb, sb2, r, ep2);
        }
        write_all(ca2, "kid!", 4);
        _exit(0);
    }
    CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0);
    read_all(sa, four, 4);
    CHECK(strcmp(four, "kid!") == 0);
    for (int r = 12; r < 15; r++) {
        exchange(ca2, sa, r, ep);
        exchange(cb, sb2, r, ep);
    }

    /* exec: sockets of both kinds survive into the new program. */
    int kinds[2][2] = {{cb, sb2}, {ca2, sa}};
    for (int k = 0; k < 2; k++) {
        child = fork();
        CHECK(child >= 0);
        if (child == 0) {
            char fd[16];
            snprintf(fd, sizeof fd, "%d", kinds[k][0]);
            execl("/proc/self/exe", argv[0], "--exec-child", fd, (char *)NULL);
            _exit(127);
        }
        CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0);
        read_all(kinds[k][1], four, 4);
        CHECK(strcmp(four, "exec") == 0);
    }
    for (int r = 15; r < 18; r++) {
        exchange(ca2, sa, r, ep);
        exchange(cb, sb2, r, ep);
    }

    /* Orderly close of the SDP pair: end of file after the data. */
    write_all(ca2, "bye", 3);
    CHECK(shutdown(ca2, SHUT_WR) == 0);
    char bye[4] = {0};
    read_all(sa, bye, 3);
    CHECK(strcmp(bye, "bye") == 0);
    CHECK(read(sa, bye, 1) == 0);
    print_report();
    close(ca2);
    close(sa);
    close(cb);
    close(sb2);
    puts("OK");
    return 0;
}
