/* Under the SDP preload: a program that reads an SDP socket with a blocking call (which
 * leaves the connection "hot", unarmed, in embedded mode) and then waits for the next
 * message by polling its descriptor with a zero timeout. The zero-timeout poll must take
 * what arrived on the hot connection (no notification comes for it), so the next message
 * shows within milliseconds, not at the stack's one-second backstop.
 *
 *   sdp_poll_zero <ip> <port>     prints the wait in µs, exits 0 when it was under 500 ms */
#include <arpa/inet.h>
#include <stddef.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static void die(const char *what) {
    perror(what);
    exit(2);
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <ip> <port>\n", argv[0]);
        return 2;
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    if (inet_pton(AF_INET, argv[1], &a.sin_addr) != 1) die("inet_pton");
    struct sockaddr_in any = a;
    any.sin_addr.s_addr = htonl(INADDR_ANY);
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    if (l < 0) die("socket");
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (struct sockaddr *)&any, sizeof any) || listen(l, 4)) die("bind/listen");
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)&a, sizeof a)) die("connect");
    int s = accept(l, NULL, NULL);
    if (s < 0) die("accept");
    char b;
    for (int round = 0; round < 20; round++) {
        /* A blocking read: the connection is left hot. */
        if (write(c, "a", 1) != 1) die("write a");
        if (read(s, &b, 1) != 1 || b != 'a') die("read a");
        /* The next message, waited for with zero-timeout polls only. */
        if (write(c, "b", 1) != 1) die("write b");
        struct pollfd p = {.fd = s, .events = POLLIN};
        double t0 = now_us(), waited;
        for (;;) {
            int n = poll(&p, 1, 0);
            if (n < 0) die("poll");
            waited = now_us() - t0;
            if (n == 1 && (p.revents & POLLIN)) break;
            if (waited > 500e3) {
                printf("round %d: not readable after %.0f us\n", round, waited);
                return 1;
            }
        }
        if (read(s, &b, 1) != 1 || b != 'b') die("read b");
        printf("round %d: readable after %.0f us\n", round, waited);
    }
    /* The library's report (its switch counters say the connection was SDP). */
    struct sockaddr_un u = {.sun_family = AF_UNIX};
    int len = snprintf(u.sun_path + 1, sizeof u.sun_path - 1, "krdma-sdp.%d", (int)getpid());
    int r = socket(AF_UNIX, SOCK_STREAM, 0);
    if (r < 0 || connect(r, (struct sockaddr *)&u, offsetof(struct sockaddr_un, sun_path) + 1 + len))
        die("report");
    char text[8192];
    ssize_t n, got = 0;
    while ((n = read(r, text + got, sizeof text - 1 - got)) > 0) got += n;
    text[got] = 0;
    printf("%s", text);
    printf("OK\n");
    return 0;
}
