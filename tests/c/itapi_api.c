/*
 * itapi_api.c -- the IT-API C interface without a peer: adapter and interface queries,
 * event dispatchers (software events, thresholds, the file descriptor, an aggregate EVD),
 * consumer contexts, busy frees, freeing a whole adapter, the calls krdma does not
 * support, and hostile input (garbage, stale and NULL handles and pointers), which must
 * come back as error statuses.
 *
 * Prints "API OK" and exits 0 on success. The adapter is $ITAPI_IA (default "siw0"):
 * siw0 (iWARP) or rxe0 (RoCEv2); what the transport decides is checked per transport.
 */
#include <it_api.h>

#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define EXPECT_STATUS(call, want)                                                      \
    do {                                                                               \
        it_status_t st_ = (call);                                                      \
        if (st_ != (want)) {                                                           \
            fprintf(stderr, "line %d: %s returned %d, expected %s (%d)\n", __LINE__,   \
                    #call, (int)st_, #want, (int)(want));                              \
            failures++;                                                                \
        }                                                                              \
    } while (0)

#define OK(call) EXPECT_STATUS(call, IT_SUCCESS)

#define EXPECT(cond)                                                                   \
    do {                                                                               \
        if (!(cond)) {                                                                 \
            fprintf(stderr, "line %d: expected %s\n", __LINE__, #cond);                \
            failures++;                                                                \
        }                                                                              \
    } while (0)

static int readable(int fd)
{
    struct pollfd p = { .fd = fd, .events = POLLIN };
    return poll(&p, 1, 0) == 1;
}

static void adapters(const char *name)
{
    it_interface_t list[8];
    size_t num = 8, total = 0;
    it_interface_list(list, &num, &total);
    EXPECT(num >= 1 && total == num);
    int found = 0;
    for (size_t i = 0; i < num; i++)
        found |= strcmp(list[i].name, name) == 0;
    EXPECT(found);

    it_ia_handle_t ia;
    EXPECT_STATUS(it_ia_create("no-such-device", 2, 1, &ia), IT_ERR_INVALID_NAME);
    EXPECT_STATUS(it_ia_create(name, 3, 0, &ia), IT_ERR_INVALID_MAJOR_VERSION);
    EXPECT_STATUS(it_ia_create(name, 2, 9, &ia), IT_ERR_INVALID_MINOR_VERSION);
    EXPECT_STATUS(it_ia_create(NULL, 2, 1, &ia), IT_ERR_INVALID_NAME);
    EXPECT_STATUS(it_ia_create(name, 2, 1, NULL), IT_ERR_FAULT);
    /* krdma extension: an adapter by an address it serves (its spigot's first; an
     * address two adapters serve names the first listed). */
    it_ia_info_t *info = NULL;
    char addr[INET6_ADDRSTRLEN] = "";
    OK(it_ia_create(name, 2, 1, &ia));
    OK(it_ia_query(ia, &info));
    EXPECT(info->num_spigots >= 1 && info->spigot_info[0].num_net_addr >= 1);
    const it_net_addr_t *a = &info->spigot_info[0].net_addr[0];
    if (a->addr_type == IT_IPV4)
        inet_ntop(AF_INET, &a->addr.ipv4, addr, sizeof addr);
    else
        inet_ntop(AF_INET6, &a->addr.ipv6, addr, sizeof addr);
    it_ia_info_free(info);
    OK(it_ia_free(ia));
    OK(it_ia_create(addr, 2, 1, &ia));
    OK(it_ia_query(ia, &info));
    /* (The tests give rxe0 an address of its own; siw0 is listed first.) */
    EXPECT(strcmp(info->ia_name, name) == 0);
    it_ia_info_free(info);
    OK(it_ia_free(ia));
    EXPECT_STATUS(it_ia_create("192.0.2.1", 2, 1, &ia), IT_ERR_INVALID_NETADDR);
}

int main(void)
{
    const char *name = getenv("ITAPI_IA") ? getenv("ITAPI_IA") : "siw0";
    it_ia_handle_t ia;
    it_pz_handle_t pz;
    it_evd_handle_t sw, dto, cm, aevd, fed;
    it_ep_handle_t ep;
    it_lmr_handle_t lmr;
    it_event_t ev;
    size_t more;
    int fd, aevd_fd;

    adapters(name);
    OK(it_ia_create(name, 2, 1, &ia));

    /* Adapter query. */
    it_ia_info_t *info = NULL;
    OK(it_ia_query(ia, &info));
    EXPECT(info != NULL && strcmp(info->ia_name, name) == 0);
    EXPECT(info->api_major_version == 2 && info->api_minor_version == 1);
    EXPECT(info->transport_type == IT_IWARP_TCP_TRANSPORT || info->transport_type == IT_IB_TRANSPORT);
    EXPECT(info->num_spigots >= 1 && info->spigot_info[0].num_net_addr >= 1);
    EXPECT(info->private_data_support == IT_TRUE && info->connect_private_data_len > 0);
    /* What the transport decides. */
    int atomics = info->atomic_support == IT_TRUE;
    if (info->transport_type == IT_IB_TRANSPORT) {
        EXPECT(info->connect_private_data_len == 56 && info->accept_private_data_len == 196 &&
               info->reject_private_data_len == 148);
        EXPECT(atomics);
    } else {
        EXPECT(info->connect_private_data_len == 256); /* 508, as far as the C events carry */
        EXPECT(!atomics);
    }
    EXPECT(info->rmr_types_supported == IT_RMR_TYPE_NARROW);
    EXPECT(info->affiliated_err_evd == IT_NULL_HANDLE);
    it_ia_info_free(info);
    it_ia_info_free((it_ia_info_t *)0x1234); /* not ours: ignored */

    /* Address conversion. */
    it_net_addr_t v4, v6, back;
    memset(&v4, 0, sizeof v4);
    v4.addr_type = IT_IPV4;
    inet_pton(AF_INET, "10.1.2.3", &v4.addr.ipv4);
    OK(it_convert_net_addr(&v4, IT_IPV6, &v6));
    EXPECT(v6.addr.ipv6.s6_addr[10] == 0xff && v6.addr.ipv6.s6_addr[15] == 3);
    OK(it_convert_net_addr(&v6, IT_IPV4, &back));
    EXPECT(back.addr.ipv4.s_addr == v4.addr.ipv4.s_addr);
    EXPECT_STATUS(it_convert_net_addr(&v4, IT_VIA_HOSTADDR, &back), IT_ERR_INVALID_CONVERSION);
    EXPECT(it_ntoh64(it_hton64(0x0102030405060708ull)) == 0x0102030405060708ull);

    /* A software-event SEVD with a descriptor, ready at 2 events. */
    OK(it_pz_create(ia, &pz));
    OK(it_evd_create(ia, IT_SOFTWARE_EVENT_STREAM, IT_EVD_CREATE_FD, 4, 2, IT_NULL_HANDLE, &sw, &fd));
    EXPECT(fd >= 0);
    OK(it_evd_post_se(sw, (void *)0x11));
    EXPECT(!readable(fd));
    EXPECT_STATUS(it_evd_wait(sw, 1000, &ev, &more), IT_ERR_TIMEOUT_EXPIRED);
    OK(it_evd_post_se(sw, (void *)0x22));
    EXPECT(readable(fd));
    OK(it_evd_wait(sw, IT_TIMEOUT_INFINITE, &ev, &more));
    EXPECT(ev.event_number == IT_SOFTWARE_EVENT && ev.sw.data == (void *)0x11 && more == 1);
    EXPECT(ev.sw.evd == sw);
    OK(it_evd_dequeue(sw, &ev));
    EXPECT(ev.sw.data == (void *)0x22);
    EXPECT_STATUS(it_evd_dequeue(sw, &ev), IT_ERR_QUEUE_EMPTY);
    /* Overflow: the fifth event does not fit. */
    for (int i = 0; i < 4; i++)
        OK(it_evd_post_se(sw, NULL));
    EXPECT_STATUS(it_evd_post_se(sw, NULL), IT_ERR_EVD_QUEUE_FULL);
    it_evd_param_t ep_param;
    OK(it_evd_query(sw, IT_EVD_PARAM_ALL, &ep_param));
    EXPECT(ep_param.evd_overflowed == IT_TRUE && ep_param.sevd_queue_size == 4);
    EXPECT(ep_param.sevd_threshold == 2 && ep_param.fd == fd && ep_param.ia == ia);
    ep_param.evd_overflowed = IT_FALSE;
    ep_param.sevd_threshold = 1;
    OK(it_evd_modify(sw, IT_EVD_PARAM_OVERFLOWED | IT_EVD_PARAM_THRESHOLD, &ep_param));
    OK(it_evd_query(sw, IT_EVD_PARAM_ALL, &ep_param));
    EXPECT(ep_param.evd_overflowed == IT_FALSE && ep_param.sevd_threshold == 1);
    EXPECT_STATUS(it_evd_modify(sw, IT_EVD_PARAM_QUEUE_SIZE, &ep_param), IT_ERR_INVALID_MASK);

    /* An aggregate EVD fed by a software SEVD. */
    OK(it_evd_create(ia, IT_AEVD_NOTIFICATION_EVENT_STREAM, IT_EVD_CREATE_FD, 16, 0,
                     IT_NULL_HANDLE, &aevd, &aevd_fd));
    OK(it_evd_create(ia, IT_SOFTWARE_EVENT_STREAM, 0, 8, 1, aevd, &fed, &fd));
    EXPECT(!readable(aevd_fd));
    OK(it_evd_post_se(fed, (void *)0x33));
    EXPECT(readable(aevd_fd));
    OK(it_evd_wait(aevd, 1000000, &ev, &more));
    EXPECT(ev.event_number == IT_SOFTWARE_EVENT && ev.sw.evd == fed && ev.sw.data == (void *)0x33);
    EXPECT_STATUS(it_evd_free(aevd), IT_ERR_EVD_BUSY); /* fed still feeds it */
    EXPECT_STATUS(it_evd_post_se(aevd, NULL), IT_ERR_AEVD_NOT_ALLOWED);

    /* An endpoint, an LMR; the PZ and EVDs are busy while they exist. */
    OK(it_evd_create(ia, IT_DTO_EVENT_STREAM, 0, 64, 1, IT_NULL_HANDLE, &dto, &fd));
    OK(it_evd_create(ia, IT_CM_MSG_EVENT_STREAM, 0, 8, 1, IT_NULL_HANDLE, &cm, &fd));
    it_ep_attributes_t attr;
    memset(&attr, 0, sizeof attr);
    attr.max_request_dtos = 8;
    attr.max_recv_dtos = 8;
    attr.max_send_segments = 1;
    attr.max_recv_segments = 1;
    attr.srv.rc.max_rdma_read_segments = 1;
    attr.srv.rc.max_rdma_write_segments = 1;
    attr.srv.rc.rdma_read_enable = IT_TRUE;
    attr.srv.rc.rdma_write_enable = IT_TRUE;
    EXPECT_STATUS(it_ep_rc_create(pz, cm, dto, cm, IT_EP_NO_FLAG, &attr, &ep), IT_ERR_INVALID_REQ_EVD);
    EXPECT_STATUS(it_ep_rc_create(pz, aevd, dto, cm, IT_EP_NO_FLAG, &attr, &ep), IT_ERR_AEVD_NOT_ALLOWED);
    attr.max_request_dtos = 1u << 30;
    EXPECT_STATUS(it_ep_rc_create(pz, dto, dto, cm, IT_EP_NO_FLAG, &attr, &ep), IT_ERR_RESOURCE_REQ_DTO);
    attr.max_request_dtos = 8;
    OK(it_ep_rc_create(pz, dto, dto, cm, IT_EP_NO_FLAG, &attr, &ep));
    it_ep_param_t epq;
    OK(it_ep_query(ep, IT_EP_PARAM_ALL, &epq));
    EXPECT(epq.ep_state.rc == IT_EP_STATE_UNCONNECTED && epq.pz == pz && epq.connect_sevd == cm);
    EXPECT(epq.attr.max_request_dtos == 8 && epq.service_type == IT_RC_SERVICE);
    EXPECT(epq.attr.srv.rc.atomics_enable == (atomics ? IT_TRUE : IT_FALSE));
    attr.srv.rc.rdma_read_ird = 2;
    OK(it_ep_modify(ep, IT_EP_PARAM_MAX_IRD, &attr));
    EXPECT_STATUS(it_ep_modify(ep, IT_EP_PARAM_MAX_REQ_DTO, &attr), IT_ERR_INVALID_MASK);

    /* Heap memory: a static array may share a page with the program's file-backed
       data, which krdma refuses to register (docs/security.md, H2). */
    enum { BUF_LEN = 8192 };
    char *buf = aligned_alloc(4096, BUF_LEN);
    memset(buf, 0, BUF_LEN);
    it_rmr_context_t ctx = 0;
    OK(it_lmr_create21(pz, buf, NULL, BUF_LEN, IT_ADDR_MODE_ABSOLUTE,
                       IT_PRIV_LOCAL | IT_PRIV_REMOTE_READ, IT_LMR_FLAG_NONE, 0, &lmr, &ctx));
    EXPECT(ctx != 0);
    it_lmr_param_t lq;
    OK(it_lmr_query(lmr, IT_LMR_PARAM_ALL, &lq));
    EXPECT(lq.addr == buf && lq.length == BUF_LEN && lq.rmr_context == ctx && lq.pz == pz);
    EXPECT_STATUS(it_lmr_create20(pz, buf, BUF_LEN, IT_ADDR_MODE_RELATIVE, IT_PRIV_LOCAL,
                                  IT_LMR_FLAG_NONE, 0, &lmr, &ctx),
                  IT_ERR_INVALID_ADDR_MODE);
    it_lmr_triplet_t seg = { .lmr = lmr, .addr.abs = buf, .length = 64 };
    it_lmr_triplet_t outside = { .lmr = lmr, .addr.abs = buf + 8190, .length = 64 };
    OK(it_post_recv(ep, &seg, 1, 1, IT_COMPLETION_FLAG));
    EXPECT_STATUS(it_post_recv(ep, &outside, 1, 2, IT_COMPLETION_FLAG), IT_ERR_RANGE);
    EXPECT_STATUS(it_post_send(ep, &seg, 1, 3, IT_COMPLETION_FLAG), IT_ERR_INVALID_EP_STATE);
    EXPECT_STATUS(it_post_recv(ep, &seg, 1, 4, IT_BARRIER_FENCE_FLAG), IT_ERR_INVALID_DTO_FLAGS);
    EXPECT_STATUS(it_ep_disconnect(ep, NULL, 0), IT_ERR_INVALID_EP_STATE);
    EXPECT_STATUS(itx_ep_disconnect_abort(ep), IT_ERR_INVALID_EP_STATE);
    EXPECT_STATUS(it_ep_disconnect(ep, (const unsigned char *)"x", 1), IT_ERR_PDATA_NOT_SUPPORTED);
    EXPECT_STATUS(it_ep_accept(ep, 123456789, NULL, 0), IT_ERR_INVALID_CN_EST_ID);
    EXPECT_STATUS(it_reject(123456789, NULL, 0), IT_ERR_INVALID_CN_EST_ID);
    EXPECT_STATUS(it_pz_free(pz), IT_ERR_PZ_BUSY);
    EXPECT_STATUS(it_evd_free(dto), IT_ERR_EVD_BUSY);

    /* Handle types and consumer contexts. */
    it_handle_type_enum_t type;
    OK(it_get_handle_type(ep, &type));
    EXPECT(type == IT_HANDLE_TYPE_EP);
    OK(it_get_handle_type(aevd, &type));
    EXPECT(type == IT_HANDLE_TYPE_EVD);
    it_context_t c = { .index = 77 }, got;
    EXPECT_STATUS(it_get_consumer_context(lmr, &got), IT_ERR_NO_CONTEXT);
    OK(it_set_consumer_context(lmr, c));
    OK(it_get_consumer_context(lmr, &got));
    EXPECT(got.index == 77);

    /* Hostile input: garbage, NULL and misaligned pointers, wrong handle kinds. */
    it_handle_t garbage = (it_handle_t)0xdeadbeef0;
    EXPECT_STATUS(it_pz_create((it_ia_handle_t)garbage, &pz), IT_ERR_INVALID_IA);
    EXPECT_STATUS(it_pz_create(IT_NULL_HANDLE, &pz), IT_ERR_INVALID_IA);
    EXPECT_STATUS(it_pz_create((it_ia_handle_t)ep, &pz), IT_ERR_INVALID_IA);
    EXPECT_STATUS(it_evd_dequeue((it_evd_handle_t)garbage, &ev), IT_ERR_INVALID_EVD);
    EXPECT_STATUS(it_evd_dequeue(sw, NULL), IT_ERR_FAULT);
    EXPECT_STATUS(it_evd_wait(sw, 0, (it_event_t *)((char *)&ev + 1), &more), IT_ERR_FAULT);
    EXPECT_STATUS(it_post_send((it_ep_handle_t)garbage, &seg, 1, 0, 0), IT_ERR_INVALID_EP);
    EXPECT_STATUS(it_post_recv(ep, NULL, 1, 0, IT_COMPLETION_FLAG), IT_ERR_FAULT);
    it_lmr_triplet_t bad = { .lmr = (it_lmr_handle_t)garbage, .addr.abs = buf, .length = 8 };
    EXPECT_STATUS(it_post_recv(ep, &bad, 1, 0, IT_COMPLETION_FLAG), IT_ERR_INVALID_LMR);
    EXPECT_STATUS(it_ep_query(ep, IT_EP_PARAM_ALL, NULL), IT_ERR_FAULT);
    EXPECT_STATUS(it_get_handle_type(garbage, &type), IT_ERR_INVALID_HANDLE);
    EXPECT_STATUS(it_ep_connect(ep, NULL, NULL, NULL, IT_CONNECT_FLAG_TWO_WAY, NULL, 0),
                  IT_ERR_INVALID_ADDRESS);
    EXPECT_STATUS(it_ep_connect(ep, NULL, NULL, NULL, IT_CONNECT_FLAG_THREE_WAY, NULL, 0),
                  IT_ERR_INVALID_CN_EST_FLAGS);
    EXPECT_STATUS(it_evd_create(ia, 0x7777, 0, 8, 1, IT_NULL_HANDLE, &sw, &fd), IT_ERR_INVALID_EVD_TYPE);
    EXPECT_STATUS(it_evd_create(ia, IT_SOFTWARE_EVENT_STREAM, 0x4000, 8, 1, IT_NULL_HANDLE, &sw, &fd),
                  IT_ERR_INVALID_FLAGS);

    /* What krdma does not support says so. */
    EXPECT_STATUS(it_ep_reset(ep), IT_ERR_OP_NOT_SUPPORTED);
    if (atomics) {
        /* rxe0: checked like any post (an 8-byte result; a connected endpoint). */
        it_lmr_triplet_t word = { .lmr = lmr, .addr.abs = buf, .length = 8 };
        EXPECT_STATUS(it_post_atomic(ep, IT_FETCH_AND_ADD, 1, 0, &seg, 0, 0, 0, 0), IT_ERR_INVALID_LENGTH);
        EXPECT_STATUS(it_post_atomic(ep, 7, 1, 0, &word, 0, 0, 0, 0), IT_ERR_INVALID_ATOMIC_OP);
        EXPECT_STATUS(it_post_atomic(ep, IT_FETCH_AND_ADD, 1, 0, &word, 0, 0, 0, 0),
                      IT_ERR_INVALID_EP_STATE);
        EXPECT_STATUS(it_post_atomic(ep, IT_COMPARE_AND_SWAP, 1, 0, NULL, 0, 0, 0, 0), IT_ERR_FAULT);
    } else {
        /* siw0: iWARP has no atomics. */
        EXPECT_STATUS(it_post_atomic(ep, IT_FETCH_AND_ADD, 1, 0, &seg, 0, 0, 0, 0),
                      IT_ERR_OP_NOT_SUPPORTED);
    }
    EXPECT_STATUS(it_ep_ud_create(pz, dto, dto, &attr, 0, &ep), IT_ERR_OP_NOT_SUPPORTED);
    EXPECT_STATUS(it_handoff(NULL, 0, 0), IT_ERR_OP_NOT_SUPPORTED);
    EXPECT_STATUS(it_mem_map(ia, buf, 0, 64, NULL, NULL), IT_ERR_OP_NOT_SUPPORTED);

    /* Freeing: dependents first is required one by one, it_ia_free frees everything. */
    it_lmr_handle_t stale = lmr;
    OK(it_lmr_free(lmr));
    EXPECT_STATUS(it_lmr_free(stale), IT_ERR_INVALID_LMR);
    EXPECT_STATUS(it_lmr_query(stale, IT_LMR_PARAM_ALL, &lq), IT_ERR_INVALID_LMR);
    OK(it_ia_free(ia));
    EXPECT_STATUS(it_ep_free(ep), IT_ERR_INVALID_EP);
    EXPECT_STATUS(it_evd_dequeue(sw, &ev), IT_ERR_INVALID_EVD);
    EXPECT_STATUS(it_ia_free(ia), IT_ERR_INVALID_IA);
    free(buf);

    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("API OK\n");
    return 0;
}
