/*
 * dapl_api.c -- a uDAPL 2.0 program against the system's libdat2 and krdma's provider
 * (DAT_OVERRIDE names it; $DAPL_IA the IA, e.g. krdma-siw0).
 *
 *   dapl_api api                      hostile and edge-case input: every answer must be
 *                                     the DAT error code, and nothing may crash
 *   dapl_api stream <ipv4> <port>     connect to a PSP, then RDMA-Write into the buffer
 *                                     the accept's private data advertises, for ever
 *                                     (the peer-death test kills it mid-transfer)
 *
 * Prints "API OK" / "STREAMING" and exits 0; any unexpected answer prints what and
 * exits 1.
 */
#include <dat2/udat.h>

#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define EXPECT_RET(call, want_type)                                                        \
    do {                                                                                   \
        DAT_RETURN r_ = (call);                                                            \
        if (DAT_GET_TYPE(r_) != (want_type)) {                                             \
            fprintf(stderr, "line %d: %s returned 0x%x, wanted type 0x%x\n", __LINE__,     \
                    #call, (unsigned)r_, (unsigned)(want_type));                           \
            failures++;                                                                    \
        }                                                                                  \
    } while (0)

#define OK(call) EXPECT_RET(call, DAT_SUCCESS)

#define MUST(call)                                                                         \
    do {                                                                                   \
        DAT_RETURN r_ = (call);                                                            \
        if (r_ != DAT_SUCCESS) {                                                           \
            fprintf(stderr, "line %d: %s failed: 0x%x\n", __LINE__, #call, (unsigned)r_); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static char *ia_name(void)
{
    static char name[] = "krdma-siw0";
    char *n = getenv("DAPL_IA");
    return n ? n : name;
}

static DAT_LMR_HANDLE reg(DAT_IA_HANDLE ia, DAT_PZ_HANDLE pz, void *buf, DAT_VLEN len,
                          DAT_LMR_CONTEXT *lctx, DAT_RMR_CONTEXT *rctx)
{
    DAT_LMR_HANDLE lmr;
    DAT_REGION_DESCRIPTION region;
    DAT_VLEN reg_len;
    DAT_VADDR reg_addr;
    region.for_va = buf;
    MUST(dat_lmr_create(ia, DAT_MEM_TYPE_VIRTUAL, region, len, pz, DAT_MEM_PRIV_ALL_FLAG,
                        DAT_VA_TYPE_VA, &lmr, lctx, rctx, &reg_len, &reg_addr));
    return lmr;
}

static int api(void)
{
    DAT_IA_HANDLE ia, ia2;
    DAT_EVD_HANDLE async = DAT_HANDLE_NULL, async2 = DAT_HANDLE_NULL;
    DAT_PZ_HANDLE pz, pz2;
    DAT_EVD_HANDLE dto, conn, cr, sw;
    DAT_EP_HANDLE ep;
    DAT_LMR_HANDLE lmr, lmr2;
    DAT_LMR_CONTEXT lctx, lctx2;
    DAT_RMR_CONTEXT rctx, rctx2;
    DAT_EVENT ev;
    DAT_COUNT nmore;
    DAT_HANDLE_TYPE type;
    /* Registered memory on the heap (a static array may share a page with the
     * program's file-backed data, which the kAL refuses to register). */
    char *buf = aligned_alloc(4096, 65536), *buf2 = aligned_alloc(4096, 4096);
    const size_t buf_len = 65536;

    MUST(dat_ia_open(ia_name(), 8, &async, &ia));
    MUST(dat_ia_open(ia_name(), 8, &async2, &ia2));
    MUST(dat_pz_create(ia, &pz));
    MUST(dat_pz_create(ia2, &pz2));
    MUST(dat_evd_create(ia, 16, DAT_HANDLE_NULL, DAT_EVD_DTO_FLAG, &dto));
    MUST(dat_evd_create(ia, 4, DAT_HANDLE_NULL, DAT_EVD_CONNECTION_FLAG, &conn));
    MUST(dat_evd_create(ia, 4, DAT_HANDLE_NULL, DAT_EVD_CR_FLAG, &cr));
    MUST(dat_evd_create(ia, 4, DAT_HANDLE_NULL, DAT_EVD_SOFTWARE_FLAG, &sw));
    MUST(dat_ep_create(ia, pz, dto, dto, conn, NULL, &ep));
    if (!buf || !buf2)
        return 1;
    lmr = reg(ia, pz, buf, buf_len, &lctx, &rctx);
    lmr2 = reg(ia2, pz2, buf2, 4096, &lctx2, &rctx2);

    /* Handle types, and a handle of the wrong kind. */
    OK(dat_get_handle_type(ep, &type));
    if (type != DAT_HANDLE_TYPE_EP) {
        fprintf(stderr, "EP handle type %d\n", type);
        failures++;
    }
    EXPECT_RET(dat_ep_free(pz), DAT_INVALID_HANDLE);       /* a PZ is no EP */
    EXPECT_RET(dat_pz_free(lmr), DAT_INVALID_HANDLE);      /* an LMR is no PZ */
    EXPECT_RET(dat_evd_dequeue(ep, &ev), DAT_INVALID_HANDLE);

    /* NULL outputs and inputs. */
    EXPECT_RET(dat_pz_create(ia, NULL), DAT_INVALID_PARAMETER);
    EXPECT_RET(dat_evd_dequeue(dto, NULL), DAT_INVALID_PARAMETER);
    EXPECT_RET(dat_ep_query(ep, DAT_EP_FIELD_ALL, NULL), DAT_INVALID_PARAMETER);
    EXPECT_RET(dat_cr_query(DAT_HANDLE_NULL, DAT_CR_FIELD_ALL, NULL), DAT_INVALID_HANDLE);

    /* Wrong sizes: a queue of nothing, a threshold above the queue, a negative count. */
    {
        DAT_EVD_HANDLE e;
        EXPECT_RET(dat_evd_create(ia, 0, DAT_HANDLE_NULL, DAT_EVD_DTO_FLAG, &e),
                   DAT_INVALID_PARAMETER);
        EXPECT_RET(dat_evd_wait(dto, 0, 17, &ev, &nmore), DAT_INVALID_PARAMETER);
        EXPECT_RET(dat_ep_post_recv(ep, -1, NULL, (DAT_DTO_COOKIE)(DAT_UINT64)0,
                                    DAT_COMPLETION_DEFAULT_FLAG),
                   DAT_INVALID_PARAMETER);
    }

    /* An empty queue, a timeout. */
    EXPECT_RET(dat_evd_dequeue(dto, &ev), DAT_QUEUE_EMPTY);
    EXPECT_RET(dat_evd_wait(dto, 1000, 1, &ev, &nmore), DAT_TIMEOUT_EXPIRED);

    /* A software event comes back with its pointer. */
    {
        DAT_EVENT se;
        memset(&se, 0, sizeof se);
        se.event_number = DAT_SOFTWARE_EVENT;
        se.event_data.software_event_data.pointer = buf;
        OK(dat_evd_post_se(sw, &se));
        OK(dat_evd_wait(sw, 1000000, 1, &ev, &nmore));
        if (ev.event_number != DAT_SOFTWARE_EVENT ||
            ev.event_data.software_event_data.pointer != buf || ev.evd_handle != sw) {
            fprintf(stderr, "software event 0x%x %p\n", ev.event_number,
                    ev.event_data.software_event_data.pointer);
            failures++;
        }
    }

    /* Another IA's objects: its PZ for an endpoint, its LMR in a work request. */
    {
        DAT_EP_HANDLE e;
        DAT_LMR_TRIPLET t;
        EXPECT_RET(dat_ep_create(ia, pz2, dto, dto, conn, NULL, &e), DAT_INVALID_HANDLE);
        t.lmr_context = lctx2;
        t.virtual_address = (DAT_VADDR)(uintptr_t)buf2;
        t.segment_length = 64;
        EXPECT_RET(dat_ep_post_recv(ep, 1, &t, (DAT_DTO_COOKIE)(DAT_UINT64)1,
                                    DAT_COMPLETION_DEFAULT_FLAG),
                   DAT_PROTECTION_VIOLATION);
        /* ...and a triplet outside its own LMR. */
        t.lmr_context = lctx;
        t.virtual_address = (DAT_VADDR)(uintptr_t)buf + buf_len - 8;
        EXPECT_RET(dat_ep_post_recv(ep, 1, &t, (DAT_DTO_COOKIE)(DAT_UINT64)1,
                                    DAT_COMPLETION_DEFAULT_FLAG),
                   DAT_PROTECTION_VIOLATION);
    }

    /* Private data over the transport's limit. */
    {
        DAT_PROVIDER_ATTR pattr;
        struct sockaddr_in to;
        static char big[4096];
        OK(dat_ia_query(ia, NULL, 0, NULL, DAT_PROVIDER_FIELD_ALL, &pattr));
        memset(&to, 0, sizeof to);
        to.sin_family = AF_INET;
        to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        EXPECT_RET(dat_ep_connect(ep, (DAT_IA_ADDRESS_PTR)&to, 45999, 1000000,
                                  pattr.max_private_data_size + 1, big, 0,
                                  DAT_CONNECT_DEFAULT_FLAG),
                   DAT_INVALID_PARAMETER);
    }

    /* Busy objects cannot be freed; then children first succeeds. */
    EXPECT_RET(dat_pz_free(pz), DAT_INVALID_STATE);   /* the EP and the LMR use it */
    EXPECT_RET(dat_evd_free(dto), DAT_INVALID_STATE); /* the EP uses it */
    EXPECT_RET(dat_ia_close(ia, DAT_CLOSE_GRACEFUL_FLAG), DAT_INVALID_STATE);
    OK(dat_ep_free(ep));
    OK(dat_lmr_free(lmr));
    OK(dat_evd_free(dto));
    OK(dat_pz_free(pz));

    /* Double frees and stale handles. */
    EXPECT_RET(dat_ep_free(ep), DAT_INVALID_HANDLE);
    EXPECT_RET(dat_lmr_free(lmr), DAT_INVALID_HANDLE);
    EXPECT_RET(dat_pz_free(pz), DAT_INVALID_HANDLE);
    EXPECT_RET(dat_evd_dequeue(dto, &ev), DAT_INVALID_HANDLE);

    OK(dat_evd_free(conn));
    OK(dat_evd_free(cr));
    OK(dat_evd_free(sw));
    OK(dat_ia_close(ia, DAT_CLOSE_GRACEFUL_FLAG));
    /* The second IA closes abruptly with its objects still there. */
    OK(dat_ia_close(ia2, DAT_CLOSE_ABRUPT_FLAG));
    EXPECT_RET(dat_lmr_free(lmr2), DAT_INVALID_HANDLE);

    if (failures) {
        fprintf(stderr, "%d unexpected answers\n", failures);
        return 1;
    }
    printf("API OK\n");
    return 0;
}

/* Connect and RDMA-Write into the advertised buffer until killed. */
static int stream(const char *host, unsigned short port)
{
    DAT_IA_HANDLE ia;
    DAT_EVD_HANDLE async = DAT_HANDLE_NULL, dto, conn;
    DAT_PZ_HANDLE pz;
    DAT_EP_HANDLE ep;
    DAT_LMR_CONTEXT lctx;
    DAT_RMR_CONTEXT rctx;
    DAT_EVENT ev;
    DAT_COUNT nmore;
    struct sockaddr_in to;
    DAT_RMR_TRIPLET target;
    const size_t buf_len = 1 << 20;
    char *buf = aligned_alloc(4096, buf_len);
    DAT_UINT64 n = 0;

    MUST(dat_ia_open(ia_name(), 8, &async, &ia));
    MUST(dat_pz_create(ia, &pz));
    MUST(dat_evd_create(ia, 64, DAT_HANDLE_NULL, DAT_EVD_DTO_FLAG, &dto));
    MUST(dat_evd_create(ia, 4, DAT_HANDLE_NULL, DAT_EVD_CONNECTION_FLAG, &conn));
    MUST(dat_ep_create(ia, pz, dto, dto, conn, NULL, &ep));
    if (!buf)
        return 1;
    reg(ia, pz, buf, buf_len, &lctx, &rctx);
    memset(&to, 0, sizeof to);
    to.sin_family = AF_INET;
    if (inet_pton(AF_INET, host, &to.sin_addr) != 1)
        return 2;
    MUST(dat_ep_connect(ep, (DAT_IA_ADDRESS_PTR)&to, port, 10000000, 0, NULL, 0,
                        DAT_CONNECT_DEFAULT_FLAG));
    MUST(dat_evd_wait(conn, 10000000, 1, &ev, &nmore));
    if (ev.event_number != DAT_CONNECTION_EVENT_ESTABLISHED ||
        ev.event_data.connect_event_data.private_data_size < (DAT_COUNT)sizeof target) {
        fprintf(stderr, "connection event 0x%x\n", ev.event_number);
        return 1;
    }
    memcpy(&target, ev.event_data.connect_event_data.private_data, sizeof target);
    printf("STREAMING\n");
    fflush(stdout);
    for (;;) {
        DAT_LMR_TRIPLET l;
        l.lmr_context = lctx;
        l.virtual_address = (DAT_VADDR)(uintptr_t)buf;
        l.segment_length = target.segment_length < buf_len ? target.segment_length
                                                              : (DAT_COUNT)buf_len;
        MUST(dat_ep_post_rdma_write(ep, 1, &l, (DAT_DTO_COOKIE)n++, &target,
                                    DAT_COMPLETION_DEFAULT_FLAG));
        MUST(dat_evd_wait(dto, 10000000, 1, &ev, &nmore));
    }
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 2 && strcmp(argv[1], "api") == 0)
        return api();
    if (argc == 4 && strcmp(argv[1], "stream") == 0)
        return stream(argv[2], (unsigned short)atoi(argv[3]));
    fprintf(stderr, "usage: %s api | stream <ipv4> <port>\n", argv[0]);
    return 2;
}
