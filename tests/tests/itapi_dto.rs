//! IT-API data transfer over siw0, both front doors: every DTO type, cookies, ordering.

mod itapi_common;

use itapi_common::*;
use krdma_itapi::*;
use krdma_tests::{crc, each_front_door, fill_pattern};

#[test]
fn itapi_send_write_read() {
    each_front_door(|door| {
        let (s, c) = pair(door, EpAttributes::default(), 1 << 20);
        let mut v = vec![0u8; 1 << 20];
        fill_pattern(&mut v, 1);
        c.buf().write(0, &v);
        s.ep.post_recv(&[s.seg(0, 1 << 20)], 11, DtoFlags::SIGNALED)
            .unwrap();
        c.ep.post_send(&[c.seg(0, 1 << 20)], 22, DtoFlags::SIGNALED)
            .unwrap();
        assert_eq!(s.expect(DtoKind::Recv, 11).transferred_length, 1 << 20);
        c.expect(DtoKind::Send, 22);
        assert_eq!(crc(&s.buf().to_vec()), crc(&v));

        fill_pattern(&mut v, 2);
        c.buf().write(0, &v);
        c.ep.post_rdma_write(&[c.seg(0, 1 << 20)], 33, DtoFlags::SIGNALED, c.remote(0))
            .unwrap();
        c.expect(DtoKind::RdmaWrite, 33);
        s.ep.post_recv(&[s.seg(0, 0)], 44, DtoFlags::SIGNALED)
            .unwrap();
        c.ep.post_send(&[], 55, DtoFlags::SIGNALED).unwrap();
        s.expect(DtoKind::Recv, 44);
        c.expect(DtoKind::Send, 55);
        assert_eq!(crc(&s.buf().to_vec()), crc(&v));

        fill_pattern(&mut v, 3);
        s.buf().write(0, &v);
        c.buf().fill(0);
        c.ep.post_rdma_read(&[c.seg(0, 1 << 20)], 66, DtoFlags::SIGNALED, c.remote(0))
            .unwrap();
        c.expect(DtoKind::RdmaRead, 66);
        assert_eq!(crc(&c.buf().to_vec()), crc(&v));
    });
}
