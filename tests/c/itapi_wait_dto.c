/*
 * itapi_wait_dto.c -- the program of issue 10's lost wake-up: one DTO EVD for both
 * queues, a receive posted before it_ep_connect / it_ep_accept, then "post one DTO,
 * it_evd_wait for its completion", alternating a 1 MiB RDMA Write and an RDMA Read of it
 * back, many times over.
 *
 *   itapi_wait_dto server [port]        (prints "LISTENING <port> <address>")
 *   itapi_wait_dto client <ipv4> <port> [rounds]
 *
 * $ITAPI_IA names the adapter (siw0, rxe0); $ITAPI_EVD_FD=1 creates the DTO EVD with
 * IT_EVD_CREATE_FD (the waiter must still be woken: the descriptor is not used). Each
 * side prints "<ROLE> OK" and exits 0, or says what failed and exits 1. Every wait has a
 * timeout far beyond what any step takes: reaching it is the failure this program
 * exists to catch.
 */
#define ITAPI_ENABLE_V21_BINDINGS
#include <it_api.h>

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define AREA (1 << 20)             /* the 1 MiB written and read back */
#define MSG 64
#define BUF (MSG + 2 * AREA)       /* [recv msg][area written from][area read into] */
#define SECOND 1000000ull          /* it_evd_wait timeouts are in microseconds */
#define WAIT (20 * SECOND)

static const char *role = "?";

#define CHECK(call)                                                                   \
    do {                                                                              \
        it_status_t st_ = (call);                                                     \
        if (st_ != IT_SUCCESS) {                                                      \
            fprintf(stderr, "%s: %s failed: status %d (line %d)\n", role, #call,      \
                    (int)st_, __LINE__);                                              \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

#define EXPECT(cond)                                                                  \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "%s: expected %s (line %d)\n", role, #cond, __LINE__);    \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

struct advert {
    uint64_t addr;
    uint64_t context;
};

struct side {
    it_ia_handle_t ia;
    it_pz_handle_t pz;
    it_evd_handle_t dto, cm;
    it_ep_handle_t ep;
    unsigned char *buf;
    it_lmr_handle_t lmr;
    it_rmr_context_t ctx;
    struct advert peer;
};

static void setup(struct side *s)
{
    const char *name = getenv("ITAPI_IA") ? getenv("ITAPI_IA") : "siw0";
    const char *fd_env = getenv("ITAPI_EVD_FD");
    it_evd_flags_t flags = fd_env && strcmp(fd_env, "1") == 0 ? IT_EVD_CREATE_FD : 0;
    int fd;
    it_ep_attributes_t attr;

    CHECK(it_ia_create(name, 2, 1, &s->ia));
    CHECK(it_pz_create(s->ia, &s->pz));
    /* One DTO EVD for the request and the receive queue. */
    CHECK(it_evd_create(s->ia, IT_DTO_EVENT_STREAM, flags, 64, 1, IT_NULL_HANDLE, &s->dto,
                        &fd));
    EXPECT(flags ? fd >= 0 : 1);
    CHECK(it_evd_create(s->ia, IT_CM_MSG_EVENT_STREAM, 0, 8, 1, IT_NULL_HANDLE, &s->cm, &fd));

    memset(&attr, 0, sizeof attr);
    attr.max_dto_payload_size = AREA;
    attr.max_request_dtos = 8;
    attr.max_recv_dtos = 8;
    attr.max_send_segments = 1;
    attr.max_recv_segments = 1;
    attr.srv.rc.rdma_read_enable = IT_TRUE;
    attr.srv.rc.rdma_write_enable = IT_TRUE;
    attr.srv.rc.max_rdma_read_segments = 1;
    attr.srv.rc.max_rdma_write_segments = 1;
    attr.srv.rc.rdma_read_ird = 4;
    attr.srv.rc.rdma_read_ord = 4;
    attr.srv.rc.srq = (it_srq_handle_t)IT_NULL_HANDLE;
    CHECK(it_ep_rc_create(s->pz, s->dto, s->dto, s->cm, IT_EP_NO_FLAG, &attr, &s->ep));

    s->buf = aligned_alloc(4096, BUF);
    EXPECT(s->buf != NULL);
    memset(s->buf, 0, BUF);
    CHECK(it_lmr_create(s->pz, s->buf, NULL, BUF, IT_ADDR_MODE_ABSOLUTE,
                        IT_PRIV_LOCAL | IT_PRIV_REMOTE, IT_LMR_FLAG_NONE, 0, &s->lmr, &s->ctx));

    /* A receive posted before the connection exists; it completes flushed at the end. */
    it_lmr_triplet_t t = { .lmr = s->lmr, .addr.abs = s->buf, .length = MSG };
    CHECK(it_post_recv(s->ep, &t, 1, 1, IT_COMPLETION_FLAG | IT_NOTIFY_FLAG));
}

/* The IPv4 address of spigot 0 a process on this host connects to. */
static const char *local_address(const struct side *s)
{
    static char text[INET_ADDRSTRLEN];
    it_ia_info_t *info;
    const char *found = NULL;

    CHECK(it_ia_query(s->ia, &info));
    EXPECT(info->num_spigots >= 1);
    for (size_t i = 0; i < info->spigot_info[0].num_net_addr && !found; i++) {
        const it_net_addr_t *a = &info->spigot_info[0].net_addr[i];
        if (a->addr_type != IT_IPV4)
            continue;
        inet_ntop(AF_INET, &a->addr.ipv4, text, sizeof text);
        if (strncmp(text, "127.", 4) == 0 || i + 1 == info->spigot_info[0].num_net_addr)
            found = text;
    }
    it_ia_info_free(info);
    EXPECT(found != NULL);
    return found;
}

static struct advert my_advert(const struct side *s)
{
    struct advert a;
    a.addr = it_hton64(it_make_rdma_addr_absolute(s->buf + MSG));
    a.context = it_hton64(s->ctx);
    return a;
}

static void take_advert(struct side *s, const unsigned char *pdata)
{
    memcpy(&s->peer, pdata, sizeof s->peer);
    s->peer.addr = it_ntoh64(s->peer.addr);
    s->peer.context = it_ntoh64(s->peer.context);
}

/* it_evd_wait for the one completion the program is waiting for. */
static void wait_dto(const struct side *s, it_event_type_t number, it_dto_cookie_t cookie,
                     int round)
{
    it_event_t ev;
    size_t more;
    it_status_t st = it_evd_wait(s->dto, WAIT, &ev, &more);
    if (st != IT_SUCCESS) {
        fprintf(stderr, "%s: it_evd_wait for cookie %llu (round %d) returned %d\n", role,
                (unsigned long long)cookie, round, (int)st);
        exit(1);
    }
    if (ev.event_number != number || ev.dto_cmpl.cookie != cookie ||
        ev.dto_cmpl.dto_status != IT_DTO_SUCCESS ||
        ev.dto_cmpl.transferred_length != AREA) {
        fprintf(stderr, "%s: got event 0x%x cookie %llu status %d length %llu, wanted 0x%x "
                "cookie %llu (round %d)\n", role, ev.event_number,
                (unsigned long long)ev.dto_cmpl.cookie, ev.dto_cmpl.dto_status,
                (unsigned long long)ev.dto_cmpl.transferred_length, number,
                (unsigned long long)cookie, round);
        exit(1);
    }
    EXPECT(more == 0);
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(i * 31 + seed + (i >> 12));
}

static int check(const unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)(i * 31 + seed + (i >> 12)))
            return 0;
    return 1;
}

/* The receive posted before the connection completes flushed once it ends. */
static void expect_flushed_recv(const struct side *s)
{
    it_event_t ev;
    size_t more;
    CHECK(it_evd_wait(s->dto, WAIT, &ev, &more));
    EXPECT(ev.event_number == IT_DTO_RC_RECV_CMPL_EVENT);
    EXPECT(ev.dto_cmpl.cookie == 1);
    EXPECT(ev.dto_cmpl.dto_status == IT_DTO_ERR_FLUSHED);
}

static void teardown(struct side *s)
{
    CHECK(it_ep_free(s->ep));
    CHECK(it_lmr_free(s->lmr));
    CHECK(it_evd_free(s->dto));
    CHECK(it_evd_free(s->cm));
    CHECK(it_pz_free(s->pz));
    CHECK(it_ia_free(s->ia));
    free(s->buf);
}

static int server(unsigned short port)
{
    struct side s;
    it_evd_handle_t req;
    it_listen_handle_t listener;
    it_conn_qual_t qual;
    it_event_t ev;
    size_t more;
    int fd;

    role = "SERVER";
    setup(&s);
    CHECK(it_evd_create(s.ia, IT_CM_REQ_EVENT_STREAM, 0, 8, 1, IT_NULL_HANDLE, &req, &fd));
    memset(&qual, 0, sizeof qual);
    qual.type = IT_IANA_PORT;
    qual.conn_qual.port = htons(port);
    CHECK(it_listen_create(s.ia, 0, req, port ? IT_LISTEN_CONN_QUAL_INPUT : IT_LISTEN_NO_FLAG,
                           &qual, &listener));
    printf("LISTENING %u %s\n", ntohs(qual.conn_qual.port), local_address(&s));
    fflush(stdout);

    CHECK(it_evd_wait(req, WAIT, &ev, &more));
    EXPECT(ev.event_number == IT_CM_REQ_CONN_REQUEST_EVENT);
    struct advert mine = my_advert(&s);
    CHECK(it_ep_accept(s.ep, ev.conn_req.cn_est_id, (const unsigned char *)&mine, sizeof mine));
    CHECK(it_evd_wait(s.cm, WAIT, &ev, &more));
    EXPECT(ev.event_number == IT_CM_MSG_CONN_ESTABLISHED_EVENT);

    /* The client writes into our area and reads it back; we only wait for its end. */
    CHECK(it_evd_wait(s.cm, 600 * SECOND, &ev, &more));
    EXPECT(ev.event_number == IT_CM_MSG_CONN_DISCONNECT_EVENT);
    expect_flushed_recv(&s);

    CHECK(it_listen_free(listener));
    CHECK(it_evd_free(req));
    teardown(&s);
    printf("SERVER OK\n");
    return 0;
}

static int client(const char *host, unsigned short port, int rounds)
{
    struct side s;
    it_net_addr_t addr;
    it_path_t path;
    size_t num = 1, total, more;
    it_conn_qual_t qual;
    it_conn_attributes_t conn_attr;
    it_event_t ev;

    role = "CLIENT";
    setup(&s);
    memset(&addr, 0, sizeof addr);
    addr.addr_type = IT_IPV4;
    EXPECT(inet_pton(AF_INET, host, &addr.addr.ipv4) == 1);
    CHECK(it_get_pathinfo(s.ia, 0, &addr, &num, &total, &path));
    memset(&qual, 0, sizeof qual);
    qual.type = IT_IANA_PORT;
    qual.conn_qual.port = htons(port);
    memset(&conn_attr, 0, sizeof conn_attr);

    struct advert mine = my_advert(&s);
    CHECK(it_ep_connect(s.ep, &path, &conn_attr, &qual, IT_CONNECT_FLAG_TWO_WAY,
                        (const unsigned char *)&mine, sizeof mine));
    CHECK(it_evd_wait(s.cm, WAIT, &ev, &more));
    EXPECT(ev.event_number == IT_CM_MSG_CONN_ESTABLISHED_EVENT);
    take_advert(&s, ev.conn.private_data);

    it_lmr_triplet_t from = { .lmr = s.lmr, .addr.abs = s.buf + MSG, .length = AREA };
    it_lmr_triplet_t into = { .lmr = s.lmr, .addr.abs = s.buf + MSG + AREA, .length = AREA };
    for (int round = 0; round < rounds; round++) {
        /* Every other round without IT_NOTIFY_FLAG: its completion still ends the wait. */
        it_dto_flags_t flags = IT_COMPLETION_FLAG | (round % 2 ? IT_NOTIFY_FLAG : 0);
        fill(s.buf + MSG, AREA, round);
        CHECK(it_post_rdma_write(s.ep, &from, 1, 2 * round + 10, flags, s.peer.addr,
                                 s.peer.context));
        wait_dto(&s, IT_DTO_RDMA_WRITE_CMPL_EVENT, 2 * round + 10, round);
        memset(s.buf + MSG + AREA, 0, AREA);
        CHECK(it_post_rdma_read(s.ep, &into, 1, 2 * round + 11, flags, s.peer.addr,
                                s.peer.context));
        wait_dto(&s, IT_DTO_RDMA_READ_CMPL_EVENT, 2 * round + 11, round);
        EXPECT(check(s.buf + MSG + AREA, AREA, round));
    }

    CHECK(it_ep_disconnect(s.ep, NULL, 0));
    CHECK(it_evd_wait(s.cm, WAIT, &ev, &more));
    EXPECT(ev.event_number == IT_CM_MSG_CONN_DISCONNECT_EVENT);
    expect_flushed_recv(&s);
    teardown(&s);
    printf("CLIENT OK %d rounds\n", rounds);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 2 && strcmp(argv[1], "server") == 0)
        return server(argc > 2 ? (unsigned short)atoi(argv[2]) : 0);
    if ((argc == 4 || argc == 5) && strcmp(argv[1], "client") == 0)
        return client(argv[2], (unsigned short)atoi(argv[3]), argc == 5 ? atoi(argv[4]) : 20);
    fprintf(stderr, "usage: %s server [port] | client <ipv4> <port> [rounds]\n", argv[0]);
    return 2;
}
