//! Listeners: passive connection setup.

use super::*;

impl Context {
    /// Listen on `addr` (port 0 picks one) of device `dev`.
    pub fn listen(
        self: &Arc<Self>,
        dev: u32,
        addr: SocketAddr,
        backlog: u32,
    ) -> Result<Arc<Listener>> {
        if let Some(udev) = self.user_device(dev)? {
            let (handle, l) = self.mirrored(dev, abi::MIRROR_LISTENER, [0; 4], (0, 0), |h| {
                udev.listen(addr, backlog, self.sink(h))
            })?;
            let port = l.local_addr().port();
            let events = self.subscribe(handle);
            return Ok(Arc::new(Listener {
                ctx: self.clone(),
                handle,
                port,
                events,
                device: Some(l),
            }));
        }
        let (gid, port) = rnicpi::sockaddr_to_parts(addr);
        let gid = if addr.ip().is_unspecified() {
            [0; 16]
        } else {
            gid
        };
        let mut a = abi::Listen {
            dev,
            backlog,
            addr: gid,
            port,
            _pad: [0; 2],
            handle: 0,
        };
        self.call(cmd::LISTEN, &mut a)?;
        let events = self.subscribe(a.handle);
        Ok(Arc::new(Listener {
            ctx: self.clone(),
            handle: a.handle,
            port: a.port,
            events,
            device: None,
        }))
    }
}

/// A listening endpoint; connection requests arrive as events.
pub struct Listener {
    ctx: Arc<Context>,
    pub handle: u32,
    pub port: u16,
    events: Receiver<Event>,
    /// The uVP's listener, on a device whose fast path is the consumer's.
    device: Option<Arc<dyn user_half::UserListener>>,
}

impl Listener {
    pub fn events(&self) -> &Receiver<Event> {
        &self.events
    }

    /// Wait for the next connection request.
    pub fn get_request(&self, timeout: Duration) -> Result<Event> {
        loop {
            let ev = self
                .events
                .recv_timeout(timeout)
                .map_err(|_| VerbsError::TimedOut)?;
            match ev.kind {
                rnicpi::EventKind::ConnectRequest => return Ok(ev),
                rnicpi::EventKind::AccessLayerDead => return Err(VerbsError::Dead),
                _ => continue,
            }
        }
    }

    pub fn accept(&self, conn_id: u64, qp: &Qp, param: &ConnParam) -> Result<()> {
        if let Some(l) = &self.device {
            let q = qp.device_qp().ok_or(VerbsError::Invalid)?;
            return l.accept(conn_id, q, param.clone());
        }
        let mut a = abi::Accept {
            listen: self.handle,
            qp: qp.handle,
            conn_id,
            ird: param.ird,
            ord: param.ord,
            ..Zeroable::zeroed()
        };
        a.pdata_len = fill_pdata(&mut a.pdata, &param.private_data)?;
        self.ctx.call(cmd::ACCEPT, &mut a)
    }

    pub fn reject(&self, conn_id: u64, private_data: &[u8]) -> Result<()> {
        if let Some(l) = &self.device {
            return l.reject(conn_id, private_data);
        }
        let mut a = abi::Reject {
            listen: self.handle,
            conn_id,
            ..Zeroable::zeroed()
        };
        a.pdata_len = fill_pdata(&mut a.pdata, private_data)?;
        self.ctx.call(cmd::REJECT, &mut a)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.ctx.destroy(cmd::DESTROY_LISTEN, self.handle);
        if let Some(l) = &self.device {
            self.ctx.keep_in_fork_child(l.clone());
        }
    }
}
