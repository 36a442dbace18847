/*
 * it_api.h -- the Interconnect Transport API (IT-API) v2.1 C interface of krdma.
 *
 * krdma's own header for libitapi. It declares the interface The Open Group's IT-API
 * v2.1 specification defines -- its function names, types, structure members and
 * constant values -- so that a program written against the standard compiles and links
 * against libitapi unchanged. Written for krdma; see docs/itapi.md for what each call
 * does here and which calls answer IT_ERR_OP_NOT_SUPPORTED.
 *
 * Binding selection, as in the standard: by default the v1.0 signatures of
 * it_lmr_create, it_rmr_create and it_rmr_bind are used; define
 * ITAPI_ENABLE_V20_BINDINGS or ITAPI_ENABLE_V21_BINDINGS before including this header
 * for the v2.0 / v2.1 ones.
 *
 * Conventions of this implementation (the standard leaves them to the implementation):
 *   - ports in it_conn_qual_t are in network byte order;
 *   - it_evd_wait timeouts are in microseconds (IT_TIMEOUT_INFINITE waits for ever);
 *   - members the standard declares as bit-fields are plain integers here;
 *   - what the transport decides (private-data lengths, atomics, RMRs) is in
 *     it_ia_query's it_ia_info_t: siw0 (iWARP) has no atomics, rxe0 (RoCEv2) has them;
 *     on InfiniBand received private data is the CM message's whole field.
 *
 * SPDX-License-Identifier: MIT OR Apache-2.0
 */

#ifndef KRDMA_IT_API_H
#define KRDMA_IT_API_H

#include <stddef.h>
#include <stdint.h>
#include <netinet/in.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(ITAPI_ENABLE_V21_BINDINGS)
#define it_lmr_create it_lmr_create21
#define it_rmr_create it_rmr_create20
#define it_rmr_bind it_rmr_link
#elif defined(ITAPI_ENABLE_V20_BINDINGS)
#define it_lmr_create it_lmr_create20
#define it_rmr_create it_rmr_create20
#define it_rmr_bind it_rmr_link
#else
#define ITAPI_ENABLE_V10_BINDINGS
#define it_lmr_create it_lmr_create10
#define it_rmr_create it_rmr_create10
#define it_rmr_bind it_rmr_bind10
#endif

/* Names kept from IT-API v1.0. */
#define rdma_read_inflight_incoming rdma_read_ird
#define rdma_read_inflight_outgoing rdma_read_ord
#define ird_support ird_ord_ia_support
#define ord_support ird_ord_ia_support
#define it_make_rdma_addr it_make_rdma_addr_absolute
#define it_lmr_sync_rdma_read it_lmr_flush_to_mem
#define it_lmr_sync_rdma_write it_lmr_refresh_from_mem
#define it_rmr_unbind it_rmr_unlink

#ifndef IN
#define IN
#endif
#ifndef OUT
#define OUT
#endif

/* ---------------------------------------------------------------- status codes */

typedef enum {
    IT_SUCCESS = 0,
    IT_ERR_ABORT = 1,
    IT_ERR_ACCESS = 2,
    IT_ERR_ADDRESS = 3,
    IT_ERR_AEVD_NOT_ALLOWED = 4,
    IT_ERR_ASYNC_AFF_EVD_EXISTS = 5,
    IT_ERR_ASYNC_UNAFF_EVD_EXISTS = 6,
    IT_ERR_CALLBACK_EXISTS = 7,
    IT_ERR_CANNOT_RESET = 8,
    IT_ERR_CONN_QUAL_BUSY = 9,
    IT_ERR_EP_BUSY = 10,
    IT_ERR_EP_TIMEWAIT = 11,
    IT_ERR_EVD_BUSY = 12,
    IT_ERR_EVD_WAIT = 13,
    IT_ERR_EVD_QUEUE_FULL = 14,
    IT_ERR_FAULT = 15,
    IT_ERR_HARD_HI_WATERMARK = 16,
    IT_ERR_IA_CATASTROPHE = 17,
    IT_ERR_INTERRUPT = 18,
    IT_ERR_INVALID_ADDR_MODE = 19,
    IT_ERR_INVALID_ADDRESS = 20,
    IT_ERR_INVALID_AEVD = 21,
    IT_ERR_INVALID_AH = 22,
    IT_ERR_INVALID_ATIMEOUT = 23,
    IT_ERR_INVALID_ATOMIC_OP = 24,
    IT_ERR_INVALID_CM_RETRY = 25,
    IT_ERR_INVALID_CN_EST_FLAGS = 26,
    IT_ERR_INVALID_CN_EST_ID = 27,
    IT_ERR_INVALID_CONN_EVD = 28,
    IT_ERR_INVALID_CONN_QUAL = 29,
    IT_ERR_INVALID_CONVERSION = 30,
    IT_ERR_INVALID_DTO_FLAGS = 31,
    IT_ERR_INVALID_EP = 32,
    IT_ERR_INVALID_EP_ATTR = 33,
    IT_ERR_INVALID_EP_KEY = 34,
    IT_ERR_INVALID_EP_STATE = 35,
    IT_ERR_INVALID_EP_TYPE = 36,
    IT_ERR_INVALID_EVD = 37,
    IT_ERR_INVALID_EVD_STATE = 38,
    IT_ERR_INVALID_EVD_TYPE = 39,
    IT_ERR_INVALID_FLAGS = 40,
    IT_ERR_INVALID_HANDLE = 41,
    IT_ERR_INVALID_IA = 42,
    IT_ERR_INVALID_IOBL = 43,
    IT_ERR_INVALID_LENGTH = 44,
    IT_ERR_INVALID_LISTEN = 45,
    IT_ERR_INVALID_LMR = 46,
    IT_ERR_INVALID_LTIMEOUT = 47,
    IT_ERR_INVALID_MAJOR_VERSION = 48,
    IT_ERR_INVALID_MASK = 49,
    IT_ERR_INVALID_MINOR_VERSION = 50,
    IT_ERR_INVALID_NAME = 51,
    IT_ERR_INVALID_NETADDR = 52,
    IT_ERR_INVALID_NUM_SEGMENTS = 53,
    IT_ERR_INVALID_PDATA_LENGTH = 54,
    IT_ERR_INVALID_PRIVS = 55,
    IT_ERR_INVALID_PZ = 56,
    IT_ERR_INVALID_QUEUE_SIZE = 57,
    IT_ERR_INVALID_RECV_DTO = 58,
    IT_ERR_INVALID_RECV_EVD = 59,
    IT_ERR_INVALID_RECV_EVD_STATE = 60,
    IT_ERR_INVALID_REQ_EVD = 61,
    IT_ERR_INVALID_REQ_EVD_STATE = 62,
    IT_ERR_INVALID_RETRY = 63,
    IT_ERR_INVALID_RMR = 64,
    IT_ERR_INVALID_RNR_RETRY = 65,
    IT_ERR_INVALID_RMR_TYPE = 66,
    IT_ERR_INVALID_RTIMEOUT = 67,
    IT_ERR_INVALID_SOFT_EVD = 68,
    IT_ERR_INVALID_SOURCE_PATH = 69,
    IT_ERR_INVALID_SPIGOT = 70,
    IT_ERR_INVALID_SRQ = 71,
    IT_ERR_INVALID_SRQ_SIZE = 72,
    IT_ERR_INVALID_THRESHOLD = 73,
    IT_ERR_INVALID_UD_STATUS = 74,
    IT_ERR_INVALID_UD_SVC = 75,
    IT_ERR_INVALID_UD_SVC_REQ_ID = 76,
    IT_ERR_INVALID_WATERMARK = 77,
    IT_ERR_LMR_BUSY = 78,
    IT_ERR_MISMATCH_FD = 79,
    IT_ERR_NO_CONTEXT = 80,
    IT_ERR_NO_PERMISSION = 81,
    IT_ERR_OP_NOT_SUPPORTED = 82,
    IT_ERR_PAYLOAD_SIZE = 83,
    IT_ERR_PDATA_NOT_SUPPORTED = 84,
    IT_ERR_PRIV_OPS_UNAVAILABLE = 85,
    IT_ERR_PZ_BUSY = 86,
    IT_ERR_QUEUE_EMPTY = 87,
    IT_ERR_RANGE = 88,
    IT_ERR_RESOURCES = 89,
    IT_ERR_RESOURCE_IRD = 90,
    IT_ERR_RESOURCE_LMR_LENGTH = 91,
    IT_ERR_RESOURCE_ORD = 92,
    IT_ERR_RESOURCE_QUEUE_SIZE = 93,
    IT_ERR_RESOURCE_RECV_DTO = 94,
    IT_ERR_RESOURCE_REQ_DTO = 95,
    IT_ERR_RESOURCE_RRSEG = 96,
    IT_ERR_RESOURCE_RSEG = 97,
    IT_ERR_RESOURCE_RWSEG = 98,
    IT_ERR_RESOURCE_SSEG = 99,
    IT_ERR_SOFT_HI_WATERMARK = 100,
    IT_ERR_SRQ_BUSY = 101,
    IT_ERR_SRQ_LOW_WATERMARK = 102,
    IT_ERR_SRQ_NOT_SUPPORTED = 103,
    IT_ERR_TIMEOUT_EXPIRED = 104,
    IT_ERR_TOO_MANY_POSTS = 105,
    IT_ERR_WAITER_LIMIT = 106
} it_status_t;

/* ---------------------------------------------------------------- scalars, handles */

typedef enum { IT_FALSE = 0, IT_TRUE = 1 } it_boolean_t;

#ifdef IT_32BIT
typedef uint32_t it_length_t;
#else
typedef uint64_t it_length_t;
#endif

typedef uint64_t it_rmr_context_t;     /* the peer's key for remote access */
typedef uint64_t it_cn_est_identifier_t; /* names a pending connection request */
typedef uint64_t it_ud_svc_req_identifier_t;
typedef uint64_t it_rdma_addr_t;       /* a remote address for RDMA Read/Write */
typedef uint64_t it_dto_cookie_t;      /* returned unchanged in the completion event */

typedef union {
    void *ptr;
    uint64_t index;
} it_context_t;

typedef void *it_handle_t;
#define IT_NULL_HANDLE ((it_handle_t)NULL)

typedef struct it_addr_handle_s *it_addr_handle_t;
typedef struct it_ep_handle_s *it_ep_handle_t;
typedef struct it_evd_handle_s *it_evd_handle_t;
typedef struct it_ia_handle_s *it_ia_handle_t;
typedef struct it_listen_handle_s *it_listen_handle_t;
typedef struct it_lmr_handle_s *it_lmr_handle_t;
typedef struct it_pz_handle_s *it_pz_handle_t;
typedef struct it_rmr_handle_s *it_rmr_handle_t;
typedef struct it_ud_svc_req_handle_s *it_ud_svc_req_handle_t;
typedef struct it_srq_handle_s *it_srq_handle_t;

typedef enum {
    IT_HANDLE_TYPE_ADDR = 0,
    IT_HANDLE_TYPE_EP = 1,
    IT_HANDLE_TYPE_EVD = 2,
    IT_HANDLE_TYPE_IA = 3,
    IT_HANDLE_TYPE_LISTEN = 4,
    IT_HANDLE_TYPE_LMR = 5,
    IT_HANDLE_TYPE_PZ = 6,
    IT_HANDLE_TYPE_RMR = 7,
    IT_HANDLE_TYPE_UD_SVC_REQ = 8,
    IT_HANDLE_TYPE_SRQ = 9
} it_handle_type_enum_t;

/* ---------------------------------------------------------------- memory */

typedef enum {
    IT_PRIV_NONE = 0x0000,
    IT_PRIV_LOCAL_READ = 0x0001,
    IT_PRIV_LOCAL_WRITE = 0x0002,
    IT_PRIV_LOCAL = 0x0003,
    IT_PRIV_DEFAULT = 0x0003,
    IT_PRIV_REMOTE_READ = 0x0004,
    IT_PRIV_REMOTE_WRITE = 0x0008,
    IT_PRIV_REMOTE = 0x000c,
    IT_PRIV_ATOMIC = 0x0010,
    IT_PRIV_ALL = 0x001f
} it_mem_priv_t;

typedef enum {
    IT_LMR_FLAG_NONE = 0x0001,
    IT_LMR_FLAG_SHARED = 0x0002,
    IT_LMR_FLAG_NONCOHERENT = 0x0004,
    IT_LMR_FLAG_NON_SHAREABLE = 0x0008
} it_lmr_flag_t;

typedef enum {
    IT_RMR_TYPE_DEFAULT = 0,
    IT_RMR_TYPE_NARROW = 1,
    IT_RMR_TYPE_WIDE = 2
} it_rmr_type_t;

typedef enum {
    IT_ADDR_MODE_ABSOLUTE = 0,
    IT_ADDR_MODE_RELATIVE = 1
} it_addr_mode_t;

typedef struct it_io_addr_s *it_io_addr_t;

typedef enum {
    IT_IOBL_PAGE_LIST = 0x0001,
    IT_IOBL_BLOCK_LIST = 0x0002,
    IT_IOBL_VE_PAGE_LIST = 0x0004
} it_iobl_type_t;

typedef struct {
    it_io_addr_t io_addr;
    it_length_t elt_len;
} it_iobl_ve_elt_t;

typedef struct {
    it_iobl_type_t iobl_type;
    union {
        struct {
            it_io_addr_t *list_elt;
            it_length_t elt_len;
        } ce_list;
        struct {
            it_iobl_ve_elt_t *list_elt;
        } ve_list;
    } list;
    size_t num_elts;
    it_length_t fbo;
} it_iobl_t;

/* A piece of an LMR: what work requests gather from and scatter into. */
typedef struct {
    it_lmr_handle_t lmr;
    union {
        void *abs;
        it_length_t rel;
        it_io_addr_t io;
    } addr;
    it_length_t length;
} it_lmr_triplet_t;

typedef struct {
    it_rmr_handle_t rmr;
    union {
        void *abs;
        it_length_t rel;
    } addr;
    it_length_t length;
} it_rmr_triplet_t;

/* ---------------------------------------------------------------- addresses, paths */

typedef enum {
    IT_IPV4 = 0x1,
    IT_IPV6 = 0x2,
    IT_IB_GID = 0x3,
    IT_VIA_HOSTADDR = 0x4
} it_net_addr_type_t;

#define IT_MAX_VIA_ADDR_LEN 64

typedef struct {
    uint16_t len;
    unsigned char hostaddr[IT_MAX_VIA_ADDR_LEN];
} it_via_net_addr_t;

typedef struct in6_addr it_ib_gid_t;

typedef struct {
    it_net_addr_type_t addr_type;
    union {
        struct in_addr ipv4;
        struct in6_addr ipv6;
        it_ib_gid_t gid;
        it_via_net_addr_t via;
    } addr;
} it_net_addr_t;

typedef enum {
    IT_IANA_PORT = 0x01,
    IT_IB_SERVICEID = 0x02,
    IT_VIA_DISCRIMINATOR = 0x04,
    IT_IANA_LR_PORT = 0x08
} it_conn_qual_type_t;

#define IT_MAX_VIA_DISC_LEN 64

typedef struct {
    uint16_t len;
    unsigned char discriminator[IT_MAX_VIA_DISC_LEN];
} it_via_discriminator_t;

typedef uint64_t it_ib_serviceid_t;

typedef struct {
    uint16_t local;
    uint16_t remote;
} it_iana_lr_port_t;

/* A connection qualifier: where a listener listens and a connect goes. */
typedef struct {
    it_conn_qual_type_t type;
    union {
        uint16_t port;
        it_ib_serviceid_t serviceid;
        it_via_discriminator_t discriminator;
        it_iana_lr_port_t lr_port;
    } conn_qual;
} it_conn_qual_t;

typedef struct {
    uint16_t partition_key;
    uint8_t path_mtu;
    uint8_t packet_lifetime;
    uint16_t local_port_lid;
    uint16_t remote_port_lid;
    it_ib_gid_t local_port_gid;
    it_ib_gid_t remote_port_gid;
    uint8_t packet_rate;
    uint8_t sl;
    uint8_t subnet_local;
    uint32_t flow_label;
    uint8_t traffic_class;
    uint8_t hop_limit;
} it_ib_net_endpoint_t;

typedef it_via_net_addr_t it_via_net_endpoint_t;

typedef enum {
    IT_IP_VERS_IPV4 = 0x1,
    IT_IP_VERS_IPV6 = 0x2
} it_ip_vers_t;

typedef union {
    struct in_addr ipv4;
    struct in6_addr ipv6;
} it_in_addr_t;

typedef struct {
    it_ip_vers_t ip_vers;
    it_in_addr_t laddr;
    it_in_addr_t raddr;
} it_iwarp_net_endpoint_t;

/* The way to a peer: which spigot, how long to try, and the addresses at both ends. */
typedef struct {
    size_t spigot_id;
    uint64_t timeout;
    union {
        it_ib_net_endpoint_t ib;
        it_via_net_endpoint_t via;
        it_iwarp_net_endpoint_t iwarp;
    } u;
} it_path_t;

typedef enum {
    IT_IB_TRANSPORT = 1,
    IT_VIA_IP_TRANSPORT = 2,
    IT_VIA_FC_TRANSPORT = 3,
    IT_IWARP_TCP_TRANSPORT = 4,
    IT_VENDOR_TRANSPORT = 1000
} it_transport_type_t;

typedef enum {
    IT_RC_SERVICE = 0x1,
    IT_UD_SERVICE = 0x2
} it_transport_service_type_t;

/* ---------------------------------------------------------------- interface adapter */

#ifndef IT_INTERFACE_NAME_SIZE
#define IT_INTERFACE_NAME_SIZE 64
#endif

typedef struct {
    uint32_t major_version;
    uint32_t minor_version;
    it_transport_type_t transport_type;
    char name[IT_INTERFACE_NAME_SIZE];
} it_interface_t;

typedef struct {
    size_t spigot_id;
    size_t max_rc_send_len;
    size_t max_rc_rdma_len;
    size_t max_ud_send_len;
    it_boolean_t spigot_online;
    it_conn_qual_type_t active_side_conn_qual;
    it_conn_qual_type_t passive_side_conn_qual;
    size_t num_net_addr;
    it_net_addr_t *net_addr;
} it_spigot_info_t;

typedef struct {
    uint32_t vendor;
    uint16_t device;
    uint32_t revision;
} it_vendor_ib_t;

typedef struct {
    char name[64];
    unsigned long hardware;
    unsigned long provider;
} it_vendor_via_t;

typedef struct {
    it_boolean_t valid_vid;
    unsigned char vid[64];
} it_vendor_iwarp_tcp_t;

typedef struct {
    char *ia_name;
    uint32_t api_major_version;
    uint32_t api_minor_version;
    uint32_t sw_major_version;
    uint32_t sw_minor_version;
    union {
        it_vendor_ib_t ib;
        it_vendor_via_t via;
        it_vendor_iwarp_tcp_t iwarp;
    } vendor;
    uint32_t dto_alignment_hint;
    it_transport_type_t transport_type;
    it_transport_service_type_t supported_service_types;
    it_boolean_t ep_work_queues_resizable;
    it_boolean_t three_way_handshake_support;
    it_boolean_t private_data_support;
    it_boolean_t max_message_size_support;
    it_boolean_t ird_ord_ia_support;
    it_boolean_t ird_ord_suppressible;
    it_boolean_t spigot_online_support;
    it_boolean_t spigot_offline_support;
    size_t connect_private_data_len;
    size_t accept_private_data_len;
    size_t reject_private_data_len;
    size_t disconnect_private_data_len;
    size_t ud_req_private_data_len;
    size_t ud_rep_private_data_len;
    size_t num_spigots;
    it_spigot_info_t *spigot_info;
    it_evd_handle_t affiliated_err_evd;
    it_evd_handle_t unaffiliated_err_evd;
    it_boolean_t srq_support;
    it_boolean_t hard_hi_watermark_support;
    it_boolean_t soft_hi_watermark_support;
    it_boolean_t srq_resizable;
    it_boolean_t extended_iwarp_qp_states;
    it_boolean_t socket_conversion_support;
    it_boolean_t rdma_read_ord_increasable;
    it_boolean_t rdma_read_ird_modifiable;
    it_rmr_type_t rmr_types_supported;
    it_boolean_t addr_mode_relative_support;
    it_boolean_t rdma_read_requires_remote_write;
    it_boolean_t ep_rdma_enables_modifiable;
    it_boolean_t rdma_read_local_extensions;
    it_boolean_t dto_evd_overflow_detection;
    it_boolean_t atomic_support;
    it_boolean_t lmr_link_support;
    it_boolean_t direct_lmr_handle_support;
    it_lmr_handle_t direct_lmr_handle;
    it_boolean_t post_send_unlink_remote_support;
    it_boolean_t narrow_rmr_unlink_support;
    it_boolean_t wide_rmr_unlink_support;
    it_boolean_t unlink_fence_support;
    it_iobl_type_t iobl_types_supported;
} it_ia_info_t;

/* ---------------------------------------------------------------- endpoints */

typedef uint32_t it_ud_ep_id_t;
typedef uint32_t it_ud_ep_key_t;

typedef enum {
    IT_EP_PARAM_ALL = 0x00000001,
    IT_EP_PARAM_IA = 0x00000002,
    IT_EP_PARAM_SPIGOT = 0x00000004,
    IT_EP_PARAM_STATE = 0x00000008,
    IT_EP_PARAM_SERV_TYPE = 0x00000010,
    IT_EP_PARAM_PATH = 0x00000020,
    IT_EP_PARAM_PZ = 0x00000040,
    IT_EP_PARAM_REQ_SEVD = 0x00000080,
    IT_EP_PARAM_RECV_SEVD = 0x00000100,
    IT_EP_PARAM_CONN_SEVD = 0x00000200,
    IT_EP_PARAM_RDMA_RD_ENABLE = 0x00000400,
    IT_EP_PARAM_RDMA_WR_ENABLE = 0x00000800,
    IT_EP_PARAM_MAX_RDMA_READ_SEG = 0x00001000,
    IT_EP_PARAM_MAX_RDMA_WRITE_SEG = 0x00002000,
    IT_EP_PARAM_MAX_IRD = 0x00004000,
    IT_EP_PARAM_MAX_ORD = 0x00008000,
    IT_EP_PARAM_EP_ID = 0x00010000,
    IT_EP_PARAM_EP_KEY = 0x00020000,
    IT_EP_PARAM_MAX_PAYLOAD = 0x00040000,
    IT_EP_PARAM_MAX_REQ_DTO = 0x00080000,
    IT_EP_PARAM_MAX_RECV_DTO = 0x00100000,
    IT_EP_PARAM_MAX_SEND_SEG = 0x00200000,
    IT_EP_PARAM_MAX_RECV_SEG = 0x00400000,
    IT_EP_PARAM_SRQ = 0x00800000,
    IT_EP_PARAM_SOFT_HI_WATERMARK = 0x01000000,
    IT_EP_PARAM_HARD_HI_WATERMARK = 0x02000000,
    IT_EP_PARAM_ATOMICS_ENABLE = 0x04000000,
    IT_EP_PARAM_PRIV_OPS_ENABLE = 0x08000000
} it_ep_param_mask_t;

typedef struct {
    it_boolean_t rdma_read_enable;
    it_boolean_t rdma_write_enable;
    size_t max_rdma_read_segments;
    size_t max_rdma_write_segments;
    uint32_t rdma_read_ird;
    uint32_t rdma_read_ord;
    it_srq_handle_t srq;
    size_t soft_hi_watermark;
    size_t hard_hi_watermark;
    it_boolean_t atomics_enable;
} it_rc_only_attributes_t;

#define IT_HARD_HI_WATERMARK_DISABLE ((size_t)-1)

typedef struct {
    it_ud_ep_id_t ud_ep_id;
    it_ud_ep_key_t ud_ep_key;
} it_remote_ep_info_t;

typedef struct {
    it_remote_ep_info_t ep_info;
} it_ud_only_attributes_t;

typedef union {
    it_rc_only_attributes_t rc;
    it_ud_only_attributes_t ud;
} it_service_attributes_t;

typedef struct {
    size_t max_dto_payload_size;
    size_t max_request_dtos;
    size_t max_recv_dtos;
    size_t max_send_segments;
    size_t max_recv_segments;
    it_service_attributes_t srv;
    it_boolean_t priv_ops_enable;
} it_ep_attributes_t;

typedef enum {
    IT_EP_STATE_UNCONNECTED = 0,
    IT_EP_STATE_ACTIVE1_CONNECTION_PENDING = 1,
    IT_EP_STATE_ACTIVE2_CONNECTION_PENDING = 2,
    IT_EP_STATE_PASSIVE_CONNECTION_PENDING = 3,
    IT_EP_STATE_CONNECTED = 4,
    IT_EP_STATE_NONOPERATIONAL = 5,
    IT_EP_STATE_PASSIVE_WAIT_RDMA_TRANS_REQ = 6
} it_ep_state_rc_t;

typedef enum {
    IT_EP_STATE_UD_OPERATIONAL = 0,
    IT_EP_STATE_UD_NONOPERATIONAL = 1
} it_ep_state_ud_t;

typedef union {
    it_ep_state_rc_t rc;
    it_ep_state_ud_t ud;
} it_ep_state_t;

typedef struct {
    it_ia_handle_t ia;
    size_t spigot_id;
    it_ep_state_t ep_state;
    it_transport_service_type_t service_type;
    it_path_t dst_path;
    it_pz_handle_t pz;
    it_evd_handle_t request_sevd;
    it_evd_handle_t recv_sevd;
    it_evd_handle_t connect_sevd;
    it_ep_attributes_t attr;
} it_ep_param_t;

typedef enum {
    IT_EP_NO_FLAG = 0x00,
    IT_EP_REUSEADDR = 0x01,
    IT_EP_SRQ = 0x02
} it_ep_rc_creation_flags_t;

typedef struct {
    uint8_t remote_cm_timeout;
    uint8_t local_cm_timeout;
    uint8_t retry_count;
    uint8_t rnr_retry_count;
    uint8_t max_cm_retries;
    uint8_t local_ack_timeout;
} it_ib_conn_attributes_t;

typedef struct {
    void *unused;
} it_via_conn_attributes_t;

typedef struct {
    void *unused;
} it_iwarp_conn_attributes_t;

typedef union {
    it_ib_conn_attributes_t ib;
    it_via_conn_attributes_t via;
    it_iwarp_conn_attributes_t iwarp;
} it_conn_attributes_t;

typedef enum {
    IT_CONNECT_FLAG_TWO_WAY = 0x0001,
    IT_CONNECT_FLAG_THREE_WAY = 0x0002,
    IT_CONNECT_SUPPRESS_IRD_ORD = 0x0004
} it_cn_est_flags_t;

/* ---------------------------------------------------------------- data transfer */

typedef enum {
    IT_COMPLETION_FLAG = 0x01,     /* queue a completion event on success */
    IT_NOTIFY_FLAG = 0x02,         /* the completion event notifies */
    IT_SOLICITED_WAIT_FLAG = 0x04, /* send: solicit the peer; recv: notify only if solicited */
    IT_BARRIER_FENCE_FLAG = 0x08,  /* wait for earlier RDMA Reads */
    IT_UNLINK_FENCE_FLAG = 0x10,   /* unlink only after earlier requests complete */
    IT_UNLINK_LOCAL_SINK = 0x20,
    IT_COALESCE_WR_FLAG = 0x40
} it_dto_flags_t;

/* krdma extension: it_post_send copies the payload into the request at post time (at
 * most the device's inline size); the segments may be reused as soon as it returns. */
#define ITX_INLINE_FLAG ((it_dto_flags_t)0x80)

typedef enum {
    IT_DTO_SUCCESS = 0,
    IT_DTO_ERR_LOCAL_LENGTH = 1,
    IT_DTO_ERR_LOCAL_EP = 2,
    IT_DTO_ERR_LOCAL_PROTECTION = 3,
    IT_DTO_ERR_FLUSHED = 4,
    IT_RMR_OPERATION_FAILED = 5,
    IT_DTO_ERR_BAD_RESPONSE = 6,
    IT_DTO_ERR_REMOTE_ACCESS = 7,
    IT_DTO_ERR_REMOTE_RESPONDER = 8,
    IT_DTO_ERR_TRANSPORT = 9,
    IT_DTO_ERR_RECEIVER_NOT_READY = 10,
    IT_DTO_ERR_PARTIAL_PACKET = 11,
    IT_DTO_ERR_LOCAL_MM_OPERATION = 12
} it_dto_status_t;

typedef enum {
    IT_COMPARE_AND_SWAP = 0,
    IT_FETCH_AND_ADD = 1
} it_atomic_op_t;

/* ---------------------------------------------------------------- events */

#define IT_EVENT_STREAM_MASK 0xff000
#define IT_TIMEOUT_INFINITE ((uint64_t)-1)
#define IT_MAX_PRIV_DATA 256

typedef enum {
    /* completions of work requests */
    IT_DTO_EVENT_STREAM = 0x00000,
    IT_DTO_SEND_CMPL_EVENT = 0x00001,
    IT_DTO_RC_RECV_CMPL_EVENT = 0x00002,
    IT_DTO_UD_RECV_CMPL_EVENT = 0x00003,
    IT_DTO_RDMA_WRITE_CMPL_EVENT = 0x00004,
    IT_DTO_RDMA_READ_CMPL_EVENT = 0x00005,
    IT_RMR_BIND_CMPL_EVENT = 0x00006,
    IT_RMR_LINK_CMPL_EVENT = 0x00006,
    IT_DTO_FETCH_ADD_CMPL_EVENT = 0x00007,
    IT_DTO_CMP_SWAP_CMPL_EVENT = 0x00008,
    IT_LMR_LINK_CMPL_EVENT = 0x00009,

    /* requests arriving at a listener */
    IT_CM_REQ_EVENT_STREAM = 0x01000,
    IT_CM_REQ_CONN_REQUEST_EVENT = 0x01001,
    IT_CM_REQ_UD_SERVICE_REQUEST_EVENT = 0x01002,

    /* what happens to an endpoint's connection */
    IT_CM_MSG_EVENT_STREAM = 0x02000,
    IT_CM_MSG_CONN_ACCEPT_ARRIVAL_EVENT = 0x02001,
    IT_CM_MSG_CONN_ESTABLISHED_EVENT = 0x02002,
    IT_CM_MSG_CONN_DISCONNECT_EVENT = 0x02003,
    IT_CM_MSG_CONN_PEER_REJECT_EVENT = 0x02004,
    IT_CM_MSG_CONN_NONPEER_REJECT_EVENT = 0x02005,
    IT_CM_MSG_CONN_BROKEN_EVENT = 0x02006,
    IT_CM_MSG_UD_SERVICE_REPLY_EVENT = 0x02007,

    /* asynchronous events affiliated with an object */
    IT_ASYNC_AFF_EVENT_STREAM = 0x04000,
    IT_ASYNC_AFF_SEVD_ENQUEUE_FAILURE = 0x04001,
    IT_ASYNC_AFF_EP_FAILURE = 0x04002,
    IT_ASYNC_AFF_EP_BAD_TRANSPORT_OPCODE = 0x04003,
    IT_ASYNC_AFF_EP_REQ_DROPPED = 0x04005,
    IT_ASYNC_AFF_EP_RDMAW_ACCESS_VIOLATION = 0x04006,
    IT_ASYNC_AFF_EP_RDMAW_CORRUPT_DATA = 0x04007,
    IT_ASYNC_AFF_EP_RDMAR_ACCESS_VIOLATION = 0x04008,
    IT_ASYNC_AFF_EP_LOCAL_ACCESS_VIOLATION = 0x04020,
    IT_ASYNC_AFF_EP_L_ACCESS_VIOLATION = 0x04020,
    IT_ASYNC_AFF_EP_L_RECV_ACCESS_VIOLATION = 0x04021,
    IT_ASYNC_AFF_EP_L_IRRQ_ACCESS_VIOLATION = 0x04022,
    IT_ASYNC_AFF_EP_L_TRANSPORT_ERROR = 0x04023,
    IT_ASYNC_AFF_EP_L_LLP_ERROR = 0x04024,
    IT_ASYNC_AFF_EP_R_ERROR = 0x04040,
    IT_ASYNC_AFF_EP_R_ACCESS_VIOLATION = 0x04041,
    IT_ASYNC_AFF_EP_R_RECV_ACCESS_VIOLATION = 0x04042,
    IT_ASYNC_AFF_EP_R_RECV_LENGTH_ERROR = 0x04043,
    IT_ASYNC_AFF_EP_SOFT_HI_WATERMARK = 0x04060,
    IT_ASYNC_AFF_EP_SRQ_ERROR = 0x04061,
    IT_ASYNC_AFF_SRQ_LOW_WATERMARK = 0x04100,

    /* asynchronous events of the adapter */
    IT_ASYNC_UNAFF_EVENT_STREAM = 0x08000,
    IT_ASYNC_UNAFF_SPIGOT_ONLINE = 0x08002,
    IT_ASYNC_UNAFF_SPIGOT_OFFLINE = 0x08003,
    IT_ASYNC_UNAFF_SEVD_ENQUEUE_FAILURE = 0x08004,

    /* events the consumer posts */
    IT_SOFTWARE_EVENT_STREAM = 0x10000,
    IT_SOFTWARE_EVENT = 0x10001,

    /* an aggregate EVD's notices */
    IT_AEVD_NOTIFICATION_EVENT_STREAM = 0x20000,
    IT_AEVD_NOTIFICATION_EVENT = 0x20001
} it_event_type_t;

typedef enum {
    IT_CN_REJ_OTHER = 0,
    IT_CN_REJ_TIMEOUT = 1,
    IT_CN_REJ_BAD_PATH = 2,
    IT_CN_REJ_STALE_CONN = 3,
    IT_CN_REJ_BAD_ORD = 4,
    IT_CN_REJ_RESOURCES = 5,
    IT_CN_REJ_BAD_CONN_PARMS = 6
} it_conn_reject_code_t;

typedef enum {
    IT_UD_SVC_EP_INFO_VALID = 0,
    IT_UD_SVC_ID_NOT_SUPPORTED = 1,
    IT_UD_SVC_REQ_REJECTED = 2,
    IT_UD_NO_EP_AVAILABLE = 3,
    IT_UD_REQ_REDIRECTED = 4
} it_ud_svc_req_status_t;

typedef enum {
    IT_UD_IB_GRH_PRESENT = 0x01
} it_dto_ud_flags_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
} it_any_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    it_ep_handle_t ep;
    it_dto_cookie_t cookie;
    it_dto_status_t dto_status;
    uint32_t transferred_length;
    it_handle_t unlinked_mr_handle;
} it_dto_cmpl_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    it_ep_handle_t ep;
    it_dto_cookie_t cookie;
    it_dto_status_t dto_status;
    uint32_t transferred_length;
    it_handle_t unlinked_mr_handle;
    it_dto_ud_flags_t flags;
    it_ud_ep_id_t ud_ep_id;
    it_path_t src_path;
} it_all_dto_cmpl_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    it_cn_est_identifier_t cn_est_id;
    it_conn_qual_t conn_qual;
    it_net_addr_t source_addr;
    size_t spigot_id;
    uint32_t max_message_size;
    uint32_t rdma_read_ird;
    uint32_t rdma_read_ord;
    unsigned char private_data[IT_MAX_PRIV_DATA];
    it_boolean_t private_data_present;
} it_conn_request_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    it_ud_svc_req_identifier_t ud_svc_req_id;
    it_conn_qual_t conn_qual;
    it_net_addr_t source_addr;
    size_t spigot_id;
    unsigned char private_data[IT_MAX_PRIV_DATA];
    it_boolean_t private_data_present;
} it_ud_svc_request_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    it_cn_est_identifier_t cn_est_id;
    it_ep_handle_t ep;
    uint32_t rdma_read_ird;
    uint32_t rdma_read_ord;
    it_path_t dst_path;
    it_conn_reject_code_t reject_reason_code;
    unsigned char private_data[IT_MAX_PRIV_DATA];
    it_boolean_t private_data_present;
} it_connection_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    it_ud_svc_req_handle_t ud_svc;
    it_ud_svc_req_status_t status;
    it_remote_ep_info_t ep_info;
    it_path_t dst_path;
    unsigned char private_data[IT_MAX_PRIV_DATA];
    it_boolean_t private_data_present;
} it_ud_svc_reply_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    union {
        it_evd_handle_t sevd;
        it_ep_handle_t ep;
        it_srq_handle_t srq;
    } cause;
} it_affiliated_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    it_ia_handle_t ia;
    size_t spigot_id;
} it_unaffiliated_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t evd;
    void *data;
} it_software_event_t;

typedef struct {
    it_event_type_t event_number;
    it_evd_handle_t aevd;
    it_evd_handle_t sevd;
} it_aevd_notification_event_t;

/* Every event: look at event_number (or any.evd), then at the member for its stream. */
typedef union {
    it_event_type_t event_number;
    it_any_event_t any;
    it_dto_cmpl_event_t dto_cmpl;
    it_all_dto_cmpl_event_t all_dto_cmpl;
    it_conn_request_event_t conn_req;
    it_ud_svc_request_event_t ud_svc_request;
    it_connection_event_t conn;
    it_ud_svc_reply_event_t ud_svc_reply;
    it_affiliated_event_t aff_async;
    it_unaffiliated_event_t unaff_async;
    it_software_event_t sw;
    it_aevd_notification_event_t aevd_notify;
} it_event_t;

/* ---------------------------------------------------------------- event dispatchers */

#define IT_THRESHOLD_DISABLE 0

typedef enum {
    IT_EVD_DEQUEUE_NOTIFICATIONS = 0x01,
    IT_EVD_CREATE_FD = 0x02,
    IT_EVD_OVERFLOW_DEFAULT = 0x04,
    IT_EVD_OVERFLOW_NOTIFY = 0x08,
    IT_EVD_OVERFLOW_AUTO_RESET = 0x10
} it_evd_flags_t;

typedef enum {
    IT_EVD_PARAM_ALL = 0x000001,
    IT_EVD_PARAM_IA = 0x000002,
    IT_EVD_PARAM_EVENT_NUMBER = 0x000004,
    IT_EVD_PARAM_FLAG = 0x000008,
    IT_EVD_PARAM_QUEUE_SIZE = 0x000010,
    IT_EVD_PARAM_THRESHOLD = 0x000020,
    IT_EVD_PARAM_AEVD_HANDLE = 0x000040,
    IT_EVD_PARAM_FD = 0x000080,
    IT_EVD_PARAM_BOUND = 0x000100,
    IT_EVD_PARAM_ENABLED = 0x000200,
    IT_EVD_PARAM_OVERFLOWED = 0x000400,
    IT_EVD_PARAM_CALLBACK = 0x000800
} it_evd_param_mask_t;

typedef struct {
    it_ia_handle_t ia;
    it_event_type_t event_number;
    it_evd_flags_t evd_flag;
    size_t sevd_queue_size;
    size_t sevd_threshold;
    it_evd_handle_t aevd;
    int fd;
    it_boolean_t evd_bound;
    it_boolean_t evd_enabled;
    it_boolean_t evd_overflowed;
    it_boolean_t evd_callback;
} it_evd_param_t;

typedef void (*it_evd_callback_rtn_t)(it_evd_handle_t evd, void *arg);

/* ---------------------------------------------------------------- listen points */

typedef enum {
    IT_LISTEN_NO_FLAG = 0x0000,
    IT_LISTEN_CONN_QUAL_INPUT = 0x0001,
    IT_LISTEN_SUPPRESS_IRD_ORD = 0x0002
} it_listen_flags_t;

typedef enum {
    IT_LISTEN_PARAM_ALL = 0x0001,
    IT_LISTEN_PARAM_IA_HANDLE = 0x0002,
    IT_LISTEN_PARAM_SPIGOT_ID = 0x0004,
    IT_LISTEN_PARAM_CONNECT_EVD = 0x0008,
    IT_LISTEN_PARAM_CONN_QUAL = 0x0010
} it_listen_param_mask_t;

typedef struct {
    it_ia_handle_t ia_handle;
    size_t spigot_id;
    it_evd_handle_t connect_evd;
    it_conn_qual_t connect_qual;
} it_listen_param_t;

/* ---------------------------------------------------------------- memory parameters */

typedef enum {
    IT_LMR_PARAM_ALL = 0x000001,
    IT_LMR_PARAM_IA = 0x000002,
    IT_LMR_PARAM_PZ = 0x000004,
    IT_LMR_PARAM_ADDR = 0x000008,
    IT_LMR_PARAM_LENGTH = 0x000010,
    IT_LMR_PARAM_MEM_PRIV = 0x000020,
    IT_LMR_PARAM_FLAG = 0x000040,
    IT_LMR_PARAM_SHARED_ID = 0x000080,
    IT_LMR_PARAM_RMR_CONTEXT = 0x000100,
    IT_LMR_PARAM_ACTUAL_ADDR = 0x000200,
    IT_LMR_PARAM_ACTUAL_LENGTH = 0x000400,
    IT_LMR_PARAM_ADDR_MODE = 0x000800,
    IT_LMR_PARAM_LINKED = 0x001000,
    IT_LMR_PARAM_IOBL_NUM_ELTS = 0x002000,
    IT_LMR_PARAM_IOBL_TYPE = 0x004000
} it_lmr_param_mask_t;

typedef struct {
    it_ia_handle_t ia;
    it_pz_handle_t pz;
    void *addr;
    it_length_t length;
    it_mem_priv_t privs;
    it_lmr_flag_t flags;
    uint32_t shared_id;
    it_rmr_context_t rmr_context;
    void *actual_addr;
    it_length_t actual_length;
    it_addr_mode_t addr_mode;
    it_boolean_t linked;
    size_t iobl_num_elts;
    it_iobl_type_t iobl_type;
} it_lmr_param_t;

typedef enum {
    IT_PZ_PARAM_ALL = 0x01,
    IT_PZ_PARAM_IA = 0x02
} it_pz_param_mask_t;

typedef struct {
    it_ia_handle_t ia;
} it_pz_param_t;

typedef enum {
    IT_RMR_PARAM_ALL = 0x000001,
    IT_RMR_PARAM_IA = 0x000002,
    IT_RMR_PARAM_PZ = 0x000004,
    IT_RMR_PARAM_LINKED = 0x000008,
    IT_RMR_PARAM_BOUND = 0x000008,
    IT_RMR_PARAM_LMR = 0x000010,
    IT_RMR_PARAM_ADDR = 0x000020,
    IT_RMR_PARAM_LENGTH = 0x000040,
    IT_RMR_PARAM_MEM_PRIV = 0x000080,
    IT_RMR_PARAM_RMR_CONTEXT = 0x000100,
    IT_RMR_PARAM_TYPE = 0x000200,
    IT_RMR_PARAM_ADDR_MODE = 0x000400
} it_rmr_param_mask_t;

typedef struct {
    it_ia_handle_t ia;
    it_pz_handle_t pz;
#ifdef ITAPI_ENABLE_V10_BINDINGS
    it_boolean_t bound;
#else
    it_boolean_t linked;
#endif
    it_lmr_handle_t lmr;
    void *addr;
    it_length_t length;
    it_mem_priv_t privs;
    it_rmr_context_t rmr_context;
    it_rmr_type_t type;
    it_addr_mode_t addr_mode;
} it_rmr_param_t;

typedef enum {
    IT_SRQ_PARAM_ALL = 0x000001,
    IT_SRQ_PARAM_IA = 0x000002,
    IT_SRQ_PARAM_PZ = 0x000004,
    IT_SRQ_PARAM_MAX_RECV_DTO = 0x000008,
    IT_SRQ_PARAM_MAX_RECV_SEG = 0x000010,
    IT_SRQ_PARAM_LOW_WATERMARK = 0x000020
} it_srq_param_mask_t;

typedef struct {
    it_ia_handle_t ia;
    it_pz_handle_t pz;
    size_t max_recv_dtos;
    size_t max_recv_segs;
    size_t low_watermark;
} it_srq_param_t;

/* ---------------------------------------------------------------- datagram service */

typedef struct {
    it_addr_handle_t addr;
    it_remote_ep_info_t ep_info;
} it_ib_ud_addr_t;

typedef enum {
    IT_DG_TYPE_IB_UD = 0
} it_dg_type_t;

typedef struct {
    it_dg_type_t type;
    union {
        it_ib_ud_addr_t ud;
    } addr;
} it_dg_remote_ep_addr_t;

typedef enum {
    IT_AH_PATH_COMPLETE = 0x1
} it_ah_flags_t;

typedef enum {
    IT_ADDR_PARAM_ALL = 0x0001,
    IT_ADDR_PARAM_IA = 0x0002,
    IT_ADDR_PARAM_PZ = 0x0004,
    IT_ADDR_PARAM_PATH = 0x0008
} it_addr_param_mask_t;

typedef struct {
    it_ia_handle_t ia;
    it_pz_handle_t pz;
    it_path_t path;
} it_addr_param_t;

typedef enum {
    IT_UD_PARAM_ALL = 0x00000001,
    IT_UD_PARAM_IA_HANDLE = 0x00000002,
    IT_UD_PARAM_REQ_ID = 0x00000004,
    IT_UD_PARAM_REPLY_EVD = 0x00000008,
    IT_UD_PARAM_CONN_QUAL = 0x00000010,
    IT_UD_PARAM_DEST_PATH = 0x00000020,
    IT_UD_PARAM_PRIV_DATA = 0x00000040,
    IT_UD_PARAM_PRIV_DATA_LENGTH = 0x00000080
} it_ud_svc_req_param_mask_t;

typedef struct {
    it_ia_handle_t ia;
    uint32_t request_id;
    it_evd_handle_t reply_evd;
    it_conn_qual_t conn_qual;
    it_path_t destination_path;
    unsigned char private_data[IT_MAX_PRIV_DATA];
    size_t private_data_length;
} it_ud_svc_req_param_t;

typedef enum {
    IT_SC_DEFAULT = 0x0000,
    IT_SC_NO_REQ_REP = 0x0001
} it_sc_flags_t;

/* ---------------------------------------------------------------- interface adapters */

void it_interface_list(OUT it_interface_t *interfaces, IN OUT size_t *num_interfaces,
                       OUT size_t *total_interfaces);
it_status_t it_ia_create(IN const char *name, IN uint32_t major_version,
                         IN uint32_t minor_version, OUT it_ia_handle_t *ia_handle);
it_status_t it_ia_free(IN it_ia_handle_t ia_handle);
it_status_t it_ia_query(IN it_ia_handle_t ia_handle, OUT it_ia_info_t **ia_info);
void it_ia_info_free(IN it_ia_info_t *ia_info);
it_status_t it_get_pathinfo(IN it_ia_handle_t ia_handle, IN size_t spigot_id,
                            IN const it_net_addr_t *net_addr, IN OUT size_t *num_paths,
                            OUT size_t *total_paths, OUT it_path_t *paths);
it_status_t it_convert_net_addr(IN const it_net_addr_t *source_addr,
                                IN it_net_addr_type_t addr_type,
                                OUT it_net_addr_t *destination_addr);

/* ---------------------------------------------------------------- handles */

it_status_t it_get_handle_type(IN it_handle_t handle, OUT it_handle_type_enum_t *type_of_handle);
it_status_t it_set_consumer_context(IN it_handle_t handle, IN it_context_t context);
it_status_t it_get_consumer_context(IN it_handle_t handle, OUT it_context_t *context);
uint64_t it_hton64(uint64_t hostint);
uint64_t it_ntoh64(uint64_t netint);

/* ---------------------------------------------------------------- protection zones */

it_status_t it_pz_create(IN it_ia_handle_t ia_handle, OUT it_pz_handle_t *pz_handle);
it_status_t it_pz_free(IN it_pz_handle_t pz_handle);
it_status_t it_pz_query(IN it_pz_handle_t pz_handle, IN it_pz_param_mask_t mask,
                        OUT it_pz_param_t *params);

/* ---------------------------------------------------------------- event dispatchers */

it_status_t it_evd_create(IN it_ia_handle_t ia_handle, IN it_event_type_t event_number,
                          IN it_evd_flags_t evd_flag, IN size_t sevd_queue_size,
                          IN size_t sevd_threshold, IN it_evd_handle_t aevd_handle,
                          OUT it_evd_handle_t *evd_handle, OUT int *fd);
it_status_t it_evd_free(IN it_evd_handle_t evd_handle);
it_status_t it_evd_dequeue(IN it_evd_handle_t evd_handle, OUT it_event_t *event);
it_status_t it_evd_wait(IN it_evd_handle_t evd_handle, IN uint64_t timeout,
                        OUT it_event_t *event, OUT size_t *nmore);
it_status_t it_evd_post_se(IN it_evd_handle_t evd_handle, IN const void *event);
it_status_t it_evd_query(IN it_evd_handle_t evd_handle, IN it_evd_param_mask_t mask,
                         OUT it_evd_param_t *params);
it_status_t it_evd_modify(IN it_evd_handle_t evd_handle, IN it_evd_param_mask_t mask,
                          IN const it_evd_param_t *params);
it_status_t it_evd_callback_attach(IN it_evd_handle_t evd_handle,
                                   IN it_evd_callback_rtn_t callback, IN void *arg);
it_status_t it_evd_callback_detach(IN it_evd_handle_t evd_handle);

/* ---------------------------------------------------------------- endpoints, connections */

it_status_t it_ep_rc_create(IN it_pz_handle_t pz_handle, IN it_evd_handle_t request_sevd_handle,
                            IN it_evd_handle_t recv_sevd_handle,
                            IN it_evd_handle_t connect_sevd_handle,
                            IN it_ep_rc_creation_flags_t flags,
                            IN const it_ep_attributes_t *ep_attr,
                            OUT it_ep_handle_t *ep_handle);
it_status_t it_ep_ud_create(IN it_pz_handle_t pz_handle, IN it_evd_handle_t request_sevd_handle,
                            IN it_evd_handle_t recv_sevd_handle,
                            IN const it_ep_attributes_t *ep_attr, IN size_t spigot_id,
                            OUT it_ep_handle_t *ep_handle);
it_status_t it_ep_free(IN it_ep_handle_t ep_handle);
it_status_t it_ep_query(IN it_ep_handle_t ep_handle, IN it_ep_param_mask_t mask,
                        OUT it_ep_param_t *params);
it_status_t it_ep_modify(IN it_ep_handle_t ep_handle, IN it_ep_param_mask_t mask,
                         IN const it_ep_attributes_t *ep_attr);
it_status_t it_ep_reset(IN it_ep_handle_t ep_handle);
it_status_t it_ep_connect(IN it_ep_handle_t ep_handle, IN const it_path_t *path,
                          IN const it_conn_attributes_t *conn_attr,
                          IN const it_conn_qual_t *connect_qual,
                          IN it_cn_est_flags_t cn_est_flags, IN const unsigned char *private_data,
                          IN size_t private_data_length);
it_status_t it_ep_accept(IN it_ep_handle_t ep_handle, IN it_cn_est_identifier_t cn_est_id,
                         IN const unsigned char *private_data, IN size_t private_data_length);
it_status_t it_reject(IN it_cn_est_identifier_t cn_est_id, IN const unsigned char *private_data,
                      IN size_t private_data_length);
it_status_t it_ep_disconnect(IN it_ep_handle_t ep_handle, IN const unsigned char *private_data,
                             IN size_t private_data_length);
it_status_t it_handoff(IN const it_conn_qual_t *conn_qual, IN size_t spigot_id,
                       IN it_cn_est_identifier_t cn_est_id);
it_status_t it_socket_convert(IN int sd, IN it_ep_handle_t ep_handle, IN it_sc_flags_t flags,
                              IN const unsigned char *msg, IN size_t len);
it_status_t it_listen_create(IN it_ia_handle_t ia_handle, IN size_t spigot_id,
                             IN it_evd_handle_t connect_evd, IN it_listen_flags_t flags,
                             IN OUT it_conn_qual_t *conn_qual,
                             OUT it_listen_handle_t *listen_handle);
it_status_t it_listen_free(IN it_listen_handle_t listen_handle);
it_status_t it_listen_query(IN it_listen_handle_t listen_handle, IN it_listen_param_mask_t mask,
                            OUT it_listen_param_t *params);

/* ---------------------------------------------------------------- memory */

it_status_t it_lmr_create10(IN it_pz_handle_t pz_handle, IN void *addr, IN it_length_t length,
                            IN it_mem_priv_t privs, IN it_lmr_flag_t flags, IN uint32_t shared_id,
                            OUT it_lmr_handle_t *lmr_handle, IN OUT it_rmr_context_t *rmr_context);
it_status_t it_lmr_create20(IN it_pz_handle_t pz_handle, IN void *addr, IN it_length_t length,
                            IN it_addr_mode_t addr_mode, IN it_mem_priv_t privs,
                            IN it_lmr_flag_t flags, IN uint32_t shared_id,
                            OUT it_lmr_handle_t *lmr_handle, IN OUT it_rmr_context_t *rmr_context);
it_status_t it_lmr_create21(IN it_pz_handle_t pz_handle, IN void *addr, IN it_iobl_t *iobl,
                            IN it_length_t length, IN it_addr_mode_t addr_mode,
                            IN it_mem_priv_t privs, IN it_lmr_flag_t flags, IN uint32_t shared_id,
                            OUT it_lmr_handle_t *lmr_handle, IN OUT it_rmr_context_t *rmr_context);
it_status_t it_lmr_create_unlinked(IN it_pz_handle_t pz_handle, IN size_t iobl_num_elts,
                                   IN it_lmr_flag_t flags, IN uint32_t shared_id,
                                   OUT it_lmr_handle_t *lmr_handle);
it_status_t it_lmr_free(IN it_lmr_handle_t lmr_handle);
it_status_t it_lmr_query(IN it_lmr_handle_t lmr_handle, IN it_lmr_param_mask_t mask,
                         OUT it_lmr_param_t *params);
it_status_t it_lmr_modify(IN it_lmr_handle_t lmr_handle, IN it_lmr_param_mask_t mask,
                          IN const it_lmr_param_t *params);
it_status_t it_lmr_link(IN it_lmr_handle_t lmr_handle, IN const void *addr,
                        IN const it_iobl_t *iobl, IN it_length_t length,
                        IN it_addr_mode_t addr_mode, IN it_mem_priv_t privs,
                        IN it_ep_handle_t ep_handle, IN it_dto_cookie_t cookie,
                        IN it_dto_flags_t dto_flags, OUT it_rmr_context_t *rmr_context);
it_status_t it_lmr_unlink(IN it_lmr_handle_t lmr_handle, IN it_ep_handle_t ep_handle,
                          IN it_dto_cookie_t cookie, IN it_dto_flags_t dto_flags);
it_status_t it_lmr_flush_to_mem(IN const it_lmr_triplet_t *local_segments,
                                IN size_t num_segments);
it_status_t it_lmr_refresh_from_mem(IN const it_lmr_triplet_t *local_segments,
                                    IN size_t num_segments);
it_rdma_addr_t it_make_rdma_addr_absolute(void *addr);
it_rdma_addr_t it_make_rdma_addr_relative(it_length_t offset);
it_status_t it_mem_map(IN it_ia_handle_t ia_handle, IN void *vaddr, IN uint64_t aspace_id,
                       IN size_t len, OUT it_io_addr_t *io_addr, OUT size_t *mapped_len);
it_status_t it_mem_unmap(IN it_ia_handle_t ia_handle, IN it_io_addr_t io_addr,
                         IN size_t mapped_len);

it_status_t it_rmr_create10(IN it_pz_handle_t pz_handle, OUT it_rmr_handle_t *rmr_handle);
it_status_t it_rmr_create20(IN it_pz_handle_t pz_handle, IN it_rmr_type_t rmr_type,
                            OUT it_rmr_handle_t *rmr_handle);
it_status_t it_rmr_free(IN it_rmr_handle_t rmr_handle);
it_status_t it_rmr_query(IN it_rmr_handle_t rmr_handle, IN it_rmr_param_mask_t mask,
                         OUT it_rmr_param_t *params);
it_status_t it_rmr_bind10(IN it_rmr_handle_t rmr_handle, IN it_lmr_handle_t lmr_handle,
                          IN void *addr, IN it_length_t length, IN it_mem_priv_t privs,
                          IN it_ep_handle_t ep_handle, IN it_dto_cookie_t cookie,
                          IN it_dto_flags_t dto_flags, OUT it_rmr_context_t *rmr_context);
it_status_t it_rmr_link(IN it_rmr_handle_t rmr_handle, IN it_lmr_handle_t lmr_handle,
                        IN void *addr, IN it_length_t length, IN it_addr_mode_t addr_mode,
                        IN it_mem_priv_t privs, IN it_ep_handle_t ep_handle,
                        IN it_dto_cookie_t cookie, IN it_dto_flags_t dto_flags,
                        OUT it_rmr_context_t *rmr_context);
it_status_t it_rmr_unlink(IN it_rmr_handle_t rmr_handle, IN it_ep_handle_t ep_handle,
                          IN it_dto_cookie_t cookie, IN it_dto_flags_t dto_flags);

it_status_t it_srq_create(IN it_pz_handle_t pz_handle, IN size_t max_recv_segments,
                          IN size_t max_recv_dtos, OUT it_srq_handle_t *srq_handle);
it_status_t it_srq_free(IN it_srq_handle_t srq_handle);
it_status_t it_srq_query(IN it_srq_handle_t srq_handle, IN it_srq_param_mask_t mask,
                         OUT it_srq_param_t *params);
it_status_t it_srq_modify(IN it_srq_handle_t srq_handle, IN it_srq_param_mask_t mask,
                          IN const it_srq_param_t *params);

/* ---------------------------------------------------------------- data transfer */

it_status_t it_post_send(IN it_ep_handle_t ep_handle, IN const it_lmr_triplet_t *local_segments,
                         IN size_t num_segments, IN it_dto_cookie_t cookie,
                         IN it_dto_flags_t dto_flags);
it_status_t it_post_send_and_unlink(IN it_ep_handle_t ep_handle,
                                    IN const it_lmr_triplet_t *local_segments,
                                    IN size_t num_segments, IN it_dto_cookie_t cookie,
                                    IN it_dto_flags_t dto_flags, IN it_rmr_context_t rmr_context);
it_status_t it_post_recv(IN it_handle_t handle, IN const it_lmr_triplet_t *local_segments,
                         IN size_t num_segments, IN it_dto_cookie_t cookie,
                         IN it_dto_flags_t dto_flags);
it_status_t it_post_rdma_read(IN it_ep_handle_t ep_handle,
                              IN const it_lmr_triplet_t *local_segments, IN size_t num_segments,
                              IN it_dto_cookie_t cookie, IN it_dto_flags_t dto_flags,
                              IN it_rdma_addr_t rdma_addr, IN it_rmr_context_t rmr_context);
it_status_t it_post_rdma_read_to_rmr(IN it_ep_handle_t ep_handle,
                                     IN const it_rmr_triplet_t *local_segments,
                                     IN size_t num_segments, IN it_dto_cookie_t cookie,
                                     IN it_dto_flags_t dto_flags, IN it_rdma_addr_t rdma_addr,
                                     IN it_rmr_context_t rmr_context);
it_status_t it_post_rdma_write(IN it_ep_handle_t ep_handle,
                               IN const it_lmr_triplet_t *local_segments, IN size_t num_segments,
                               IN it_dto_cookie_t cookie, IN it_dto_flags_t dto_flags,
                               IN it_rdma_addr_t rdma_addr, IN it_rmr_context_t rmr_context);
it_status_t it_post_atomic(IN it_ep_handle_t ep_handle, IN it_atomic_op_t op,
                           IN uint64_t swap_or_add, IN uint64_t compare,
                           IN const it_lmr_triplet_t *result, IN it_dto_cookie_t cookie,
                           IN it_dto_flags_t dto_flags, IN it_rdma_addr_t rdma_addr,
                           IN it_rmr_context_t rmr_context);

/* ---------------------------------------------------------------- datagram service */

it_status_t it_address_handle_create(IN it_pz_handle_t pz_handle,
                                     IN const it_path_t *destination_path,
                                     IN it_ah_flags_t ah_flags, OUT it_addr_handle_t *addr_handle);
it_status_t it_address_handle_free(IN it_addr_handle_t addr_handle);
it_status_t it_address_handle_modify(IN it_addr_handle_t addr_handle,
                                     IN it_addr_param_mask_t mask,
                                     IN const it_addr_param_t *params);
it_status_t it_address_handle_query(IN it_addr_handle_t addr_handle, IN it_addr_param_mask_t mask,
                                    OUT it_addr_param_t *params);
it_status_t it_post_sendto(IN it_ep_handle_t ep_handle, IN const it_lmr_triplet_t *local_segments,
                           IN size_t num_segments, IN it_dto_cookie_t cookie,
                           IN it_dto_flags_t dto_flags,
                           IN const it_dg_remote_ep_addr_t *remote_ep_addr);
it_status_t it_post_recvfrom(IN it_ep_handle_t ep_handle,
                             IN const it_lmr_triplet_t *local_segments, IN size_t num_segments,
                             IN it_dto_cookie_t cookie, IN it_dto_flags_t dto_flags);
it_status_t it_ud_service_request_handle_create(IN const it_conn_qual_t *conn_qual,
                                               IN it_evd_handle_t reply_evd,
                                               IN const it_path_t *destination_path,
                                               IN const unsigned char *private_data,
                                               IN size_t private_data_length,
                                               OUT it_ud_svc_req_handle_t *ud_svc_handle);
it_status_t it_ud_service_request_handle_free(IN it_ud_svc_req_handle_t ud_svc_handle);
it_status_t it_ud_service_request_handle_query(IN it_ud_svc_req_handle_t ud_svc_handle,
                                               IN it_ud_svc_req_param_mask_t mask,
                                               OUT it_ud_svc_req_param_t *ud_svc_handle_info);
it_status_t it_ud_service_request(IN it_ud_svc_req_handle_t ud_svc_handle);
it_status_t it_ud_service_reply(IN it_ud_svc_req_identifier_t ud_svc_req_id,
                                IN it_ud_svc_req_status_t status, IN it_remote_ep_info_t ep_info,
                                IN const unsigned char *private_data,
                                IN size_t private_data_length);

/* ---------------------------------------------------------------- krdma extensions */

/* Abortive disconnect: reset the connection at once (the peer sees
 * IT_CM_MSG_CONN_BROKEN_EVENT); outstanding work completes with IT_DTO_ERR_FLUSHED. */
it_status_t itx_ep_disconnect_abort(IN it_ep_handle_t ep_handle);

/* The length of the private data of a connection request or connection event that
 * it_evd_dequeue / it_evd_wait returned last on this thread (the standard's events only
 * say whether some is present). */
size_t itx_last_private_data_length(void);

#ifdef __cplusplus
}
#endif

#endif /* KRDMA_IT_API_H */
