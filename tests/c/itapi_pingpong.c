/*
 * itapi_pingpong.c -- an IT-API v2.1 program: connect, ping-pong Sends, an RDMA Write
 * and an RDMA Read with verification, then disconnect.
 *
 *   itapi_pingpong server [port]        (port 0 or absent: pick one; prints
 *                                        "LISTENING <port> <address>")
 *   itapi_pingpong client <ipv4> <port>
 *
 * The interface adapter is $ITAPI_IA (default "siw0"; rxe0 for RoCEv2). The server's
 * address is the one its adapter's spigot serves on loopback (what the client connects
 * to from the same host). Each side prints "<ROLE> OK" and exits 0 on success; any
 * failure prints what failed and exits 1.
 *
 * Written against the standard's interface only (plus <it_api.h>), with the v2.1
 * bindings; the server waits with it_evd_wait, the client polls the DTO EVD's file
 * descriptor and dequeues.
 */
#define ITAPI_ENABLE_V21_BINDINGS
#include <it_api.h>

#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PINGS 100
#define MSG 64
#define AREA 65536                 /* each side's RDMA area */
#define BUF (2 * MSG + AREA)       /* [recv msg][send msg][RDMA area] */
#define SECOND 1000000ull          /* it_evd_wait timeouts are in microseconds */

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

/* What each side tells the other in its private data: where its RDMA area is. */
struct advert {
    uint64_t addr;
    uint64_t context;
    uint64_t length;
};

struct side {
    it_ia_handle_t ia;
    it_pz_handle_t pz;
    it_evd_handle_t dto, cm;
    int dto_fd;
    it_ep_handle_t ep;
    unsigned char *buf;
    int ib; /* InfiniBand transport (rxe0) */
    it_lmr_handle_t lmr;
    it_rmr_context_t ctx;
    struct advert peer;
};

static void setup(struct side *s)
{
    const char *name = getenv("ITAPI_IA") ? getenv("ITAPI_IA") : "siw0";
    int fd;
    it_ep_attributes_t attr;

    it_ia_info_t *info;

    CHECK(it_ia_create(name, 2, 1, &s->ia));
    CHECK(it_ia_query(s->ia, &info));
    s->ib = info->transport_type == IT_IB_TRANSPORT;
    it_ia_info_free(info);
    CHECK(it_pz_create(s->ia, &s->pz));
    CHECK(it_evd_create(s->ia, IT_DTO_EVENT_STREAM, IT_EVD_CREATE_FD, 64, 1,
                        IT_NULL_HANDLE, &s->dto, &s->dto_fd));
    EXPECT(s->dto_fd >= 0);
    CHECK(it_evd_create(s->ia, IT_CM_MSG_EVENT_STREAM, 0, 8, 1, IT_NULL_HANDLE, &s->cm, &fd));

    memset(&attr, 0, sizeof attr);
    attr.max_dto_payload_size = AREA;
    attr.max_request_dtos = 16;
    attr.max_recv_dtos = 16;
    attr.max_send_segments = 2;
    attr.max_recv_segments = 2;
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
}

/* The IPv4 address of spigot 0 that a process on this host connects to: a loopback one
 * (siw0: 127.0.0.1; rxe0: the address it is bound to), else the first. */
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
    a.addr = it_hton64(it_make_rdma_addr_absolute(s->buf + 2 * MSG));
    a.context = it_hton64(s->ctx);
    a.length = it_hton64(AREA);
    return a;
}

static void take_advert(struct side *s, const unsigned char *pdata)
{
    memcpy(&s->peer, pdata, sizeof s->peer);
    s->peer.addr = it_ntoh64(s->peer.addr);
    s->peer.context = it_ntoh64(s->peer.context);
    s->peer.length = it_ntoh64(s->peer.length);
}

static it_lmr_triplet_t seg(const struct side *s, size_t offset, size_t len)
{
    it_lmr_triplet_t t;
    t.lmr = s->lmr;
    t.addr.abs = s->buf + offset;
    t.length = len;
    return t;
}

static void post_recv(const struct side *s, it_dto_cookie_t cookie)
{
    it_lmr_triplet_t t = seg(s, 0, MSG);
    CHECK(it_post_recv(s->ep, &t, 1, cookie, IT_COMPLETION_FLAG | IT_NOTIFY_FLAG));
}

/* Send `text` from the buffer's send slot; `extra` adds flags (ITX_INLINE_FLAG: the
 * bytes are copied at post time, krdma's extension). */
static void post_send(const struct side *s, it_dto_cookie_t cookie, const char *text,
                      it_dto_flags_t extra)
{
    it_lmr_triplet_t t = seg(s, MSG, MSG);
    snprintf((char *)s->buf + MSG, MSG, "%s", text);
    CHECK(it_post_send(s->ep, &t, 1, cookie, IT_COMPLETION_FLAG | IT_NOTIFY_FLAG | extra));
}

/* The next event of the DTO EVD: the server waits in it_evd_wait, the client sleeps in
 * poll(2) on the EVD's descriptor and dequeues. */
static void next_dto(const struct side *s, int use_fd, it_event_t *ev)
{
    size_t more;
    if (!use_fd) {
        CHECK(it_evd_wait(s->dto, 10 * SECOND, ev, &more));
        return;
    }
    for (;;) {
        struct pollfd p = { .fd = s->dto_fd, .events = POLLIN };
        it_status_t st = it_evd_dequeue(s->dto, ev);
        if (st == IT_SUCCESS)
            return;
        EXPECT(st == IT_ERR_QUEUE_EMPTY);
        EXPECT(poll(&p, 1, 10000) == 1);
    }
}

static void expect_dto(const struct side *s, int use_fd, it_event_type_t number,
                       it_dto_cookie_t cookie)
{
    it_event_t ev;
    next_dto(s, use_fd, &ev);
    if (ev.event_number != number || ev.dto_cmpl.cookie != cookie ||
        ev.dto_cmpl.dto_status != IT_DTO_SUCCESS) {
        fprintf(stderr, "%s: got event 0x%x cookie %llu status %d, wanted 0x%x cookie %llu\n",
                role, ev.event_number, (unsigned long long)ev.dto_cmpl.cookie,
                ev.dto_cmpl.dto_status, number, (unsigned long long)cookie);
        exit(1);
    }
    EXPECT(ev.dto_cmpl.ep == s->ep);
    EXPECT(ev.dto_cmpl.evd == s->dto);
}

/* A send completion and a receive completion, in either order (the peer's answer may
 * land before our send's completion is reported). */
static void expect_send_and_recv(const struct side *s, int use_fd, it_dto_cookie_t send,
                                 it_dto_cookie_t recv)
{
    int got_send = 0, got_recv = 0;
    while (!(got_send && got_recv)) {
        it_event_t ev;
        next_dto(s, use_fd, &ev);
        EXPECT(ev.dto_cmpl.dto_status == IT_DTO_SUCCESS);
        if (ev.event_number == IT_DTO_SEND_CMPL_EVENT && ev.dto_cmpl.cookie == send && !got_send)
            got_send = 1;
        else if (ev.event_number == IT_DTO_RC_RECV_CMPL_EVENT && ev.dto_cmpl.cookie == recv &&
                 !got_recv)
            got_recv = 1;
        else {
            fprintf(stderr, "%s: unexpected event 0x%x cookie %llu\n", role, ev.event_number,
                    (unsigned long long)ev.dto_cmpl.cookie);
            exit(1);
        }
    }
}

static it_event_type_t next_cm(const struct side *s, it_event_t *ev)
{
    size_t more;
    CHECK(it_evd_wait(s->cm, 10 * SECOND, ev, &more));
    return ev->event_number;
}

static void fill(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(i * 31 + seed);
}

static int check(const unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)(i * 31 + seed))
            return 0;
    return 1;
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

    CHECK(it_evd_wait(req, 30 * SECOND, &ev, &more));
    EXPECT(ev.event_number == IT_CM_REQ_CONN_REQUEST_EVENT);
    EXPECT(ev.conn_req.private_data_present == IT_TRUE);
    /* iWARP carries the length; the IB CM a whole field (the advert, then zeros). */
    EXPECT(itx_last_private_data_length() == (s.ib ? 56 : sizeof(struct advert)));
    take_advert(&s, ev.conn_req.private_data);
    EXPECT(s.peer.length == AREA);

    post_recv(&s, 1);
    struct advert mine = my_advert(&s);
    CHECK(it_ep_accept(s.ep, ev.conn_req.cn_est_id, (const unsigned char *)&mine, sizeof mine));
    EXPECT(next_cm(&s, &ev) == IT_CM_MSG_CONN_ESTABLISHED_EVENT);
    EXPECT(ev.conn.ep == s.ep);

    /* Ping-pong: answer each ping with a pong carrying the same number. The next ping
     * may arrive before the pong's send completion is reported. */
    expect_dto(&s, 0, IT_DTO_RC_RECV_CMPL_EVENT, 1);
    for (int i = 0; i < PINGS; i++) {
        char text[MSG];
        int n = -1;
        EXPECT(sscanf((char *)s.buf, "ping %d", &n) == 1 && n == i);
        snprintf(text, sizeof text, "pong %d", i);
        post_recv(&s, 1);
        post_send(&s, 100 + i, text, ITX_INLINE_FLAG);
        /* ... and then the next message: a ping, or "written" after the last one. */
        expect_send_and_recv(&s, 0, 100 + i, 1);
    }

    /* The client RDMA-Writes a pattern into our area, then says so. */
    EXPECT(strcmp((char *)s.buf, "written") == 0);
    EXPECT(check(s.buf + 2 * MSG, AREA, 7));

    /* Our own pattern for the client to RDMA-Read; tell it when it is there. */
    fill(s.buf + 2 * MSG, AREA, 9);
    post_recv(&s, 1);
    post_send(&s, 200, "read it", 0);
    expect_dto(&s, 0, IT_DTO_SEND_CMPL_EVENT, 200);

    /* The client disconnects; our posted receive completes flushed. */
    EXPECT(next_cm(&s, &ev) == IT_CM_MSG_CONN_DISCONNECT_EVENT);
    it_event_t flushed;
    CHECK(it_evd_wait(s.dto, 10 * SECOND, &flushed, &more));
    EXPECT(flushed.event_number == IT_DTO_RC_RECV_CMPL_EVENT);
    EXPECT(flushed.dto_cmpl.dto_status == IT_DTO_ERR_FLUSHED);

    CHECK(it_listen_free(listener));
    CHECK(it_evd_free(req));
    teardown(&s);
    printf("SERVER OK\n");
    return 0;
}

static int client(const char *host, unsigned short port)
{
    struct side s;
    it_net_addr_t addr;
    it_path_t path;
    size_t num = 1, total;
    it_conn_qual_t qual;
    it_conn_attributes_t conn_attr;
    it_event_t ev;

    role = "CLIENT";
    setup(&s);
    memset(&addr, 0, sizeof addr);
    addr.addr_type = IT_IPV4;
    EXPECT(inet_pton(AF_INET, host, &addr.addr.ipv4) == 1);
    CHECK(it_get_pathinfo(s.ia, 0, &addr, &num, &total, &path));
    EXPECT(num == 1);
    memset(&qual, 0, sizeof qual);
    qual.type = IT_IANA_PORT;
    qual.conn_qual.port = htons(port);
    memset(&conn_attr, 0, sizeof conn_attr);

    post_recv(&s, 1);
    struct advert mine = my_advert(&s);
    CHECK(it_ep_connect(s.ep, &path, &conn_attr, &qual, IT_CONNECT_FLAG_TWO_WAY,
                        (const unsigned char *)&mine, sizeof mine));
    EXPECT(next_cm(&s, &ev) == IT_CM_MSG_CONN_ESTABLISHED_EVENT);
    EXPECT(ev.conn.private_data_present == IT_TRUE);
    EXPECT(itx_last_private_data_length() == (s.ib ? 196 : sizeof(struct advert)));
    take_advert(&s, ev.conn.private_data);
    EXPECT(s.peer.length == AREA);

    for (int i = 0; i < PINGS; i++) {
        char text[MSG];
        int n = -1;
        snprintf(text, sizeof text, "ping %d", i);
        post_send(&s, 100 + i, text, 0);
        expect_send_and_recv(&s, 1, 100 + i, 1);
        EXPECT(sscanf((char *)s.buf, "pong %d", &n) == 1 && n == i);
        post_recv(&s, 1);
    }

    /* RDMA Write a pattern into the server's area; the Send after it arrives after it. */
    fill(s.buf + 2 * MSG, AREA, 7);
    it_lmr_triplet_t area = seg(&s, 2 * MSG, AREA);
    CHECK(it_post_rdma_write(s.ep, &area, 1, 300, IT_COMPLETION_FLAG | IT_NOTIFY_FLAG,
                             s.peer.addr, s.peer.context));
    expect_dto(&s, 1, IT_DTO_RDMA_WRITE_CMPL_EVENT, 300);
    post_send(&s, 301, "written", 0);

    /* When told, RDMA Read the server's new pattern back. */
    expect_send_and_recv(&s, 1, 301, 1);
    EXPECT(strcmp((char *)s.buf, "read it") == 0);
    memset(s.buf + 2 * MSG, 0, AREA);
    CHECK(it_post_rdma_read(s.ep, &area, 1, 400, IT_COMPLETION_FLAG | IT_NOTIFY_FLAG,
                            s.peer.addr, s.peer.context));
    expect_dto(&s, 1, IT_DTO_RDMA_READ_CMPL_EVENT, 400);
    EXPECT(check(s.buf + 2 * MSG, AREA, 9));

    CHECK(it_ep_disconnect(s.ep, NULL, 0));
    EXPECT(next_cm(&s, &ev) == IT_CM_MSG_CONN_DISCONNECT_EVENT);
    teardown(&s);
    printf("CLIENT OK\n");
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 2 && strcmp(argv[1], "server") == 0)
        return server(argc > 2 ? (unsigned short)atoi(argv[2]) : 0);
    if (argc == 4 && strcmp(argv[1], "client") == 0)
        return client(argv[2], (unsigned short)atoi(argv[3]));
    fprintf(stderr, "usage: %s server [port] | client <ipv4> <port>\n", argv[0]);
    return 2;
}
