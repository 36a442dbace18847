//! Service points and connection requests: a PSP listens on a connection qualifier for
//! any number of requests, an RSP for one, on behalf of one endpoint; each request
//! arrives as a [`Cr`] to query, accept or reject.

use crate::ep::Ep;
use crate::error::{Error, Major, Minor, Result};
use crate::evd::Evd;
use crate::ia::{next_id, Ia};
use krdma_itapi as it;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};

/// A public service point (`dat_psp_create`): connection requests to `conn_qual` (the
/// port) arrive on its CR EVD.
///
/// ```no_run
/// use krdma_dapl::*;
/// use std::time::Duration;
///
/// let ia = Ia::open("siw0")?;
/// let cr_evd = Evd::create(&ia, 8, None, EvdFlags::CR)?;
/// let psp = Psp::create(&ia, 45248, &cr_evd)?;
/// let Event::ConnRequest(cr) = cr_evd.wait(None, 1)?.0 else { unreachable!() };
/// println!("request from {:?} with {} bytes", cr.remote(), cr.private_data().len());
/// # let ep: Ep = unimplemented!();
/// cr.accept(Some(&ep), b"welcome")?;
/// # let _ = psp;
/// # Ok::<(), krdma_dapl::Error>(())
/// ```
#[derive(Clone)]
pub struct Psp(pub(crate) Arc<SpInner>);

/// A reserved service point (`dat_rsp_create`): one connection, for one endpoint.
#[derive(Clone)]
pub struct Rsp(pub(crate) Arc<SpInner>);

pub struct SpInner {
    pub(crate) id: u64,
    ia: Ia,
    listener: it::Listener,
    evd: Evd,
    /// RSP: the endpoint requests are for.
    ep: Option<Ep>,
}

/// A service point, as a connection request names it.
#[derive(Clone)]
pub(crate) struct SpRef {
    sp: Weak<SpInner>,
}

fn listen(ia: &Ia, conn_qual: u64, evd: &Evd, ep: Option<&Ep>) -> Result<Arc<SpInner>> {
    if evd.ia().id() != ia.id() {
        return Err(Error::handle(Minor::HandleEvdCr));
    }
    let port = crate::port_of(conn_qual);
    let cr_sevd = evd
        .core_for(it::EventStream::CmRequest)
        .ok_or(Error::handle(Minor::HandleEvdCr))?;
    let listener = it::Listener::create(ia.core(), 0, cr_sevd, port).map_err(|e| match e {
        it::Error::InvalidConnQual | it::Error::ConnQualBusy => Error::of(Major::ConnQualInUse),
        other => other.into(),
    })?;
    // DAT consumers tell UD requests by their event number (IB extension) and answer
    // them with UD endpoints.
    listener.take_ud_requests();
    let inner = Arc::new(SpInner {
        id: next_id(),
        ia: ia.clone(),
        listener,
        evd: evd.clone(),
        ep: ep.cloned(),
    });
    ia.0.sps.lock().insert(
        inner.listener.port(),
        SpRef {
            sp: Arc::downgrade(&inner),
        },
    );
    tracing::info!(
        id = inner.id,
        port = inner.listener.port(),
        rsp = ep.is_some(),
        "service point"
    );
    Ok(inner)
}

impl Psp {
    /// Listen on `conn_qual` (its low 16 bits are the port, as with the RDMA CM);
    /// requests go to `evd` (a CR EVD).
    pub fn create(ia: &Ia, conn_qual: u64, evd: &Evd) -> Result<Psp> {
        if crate::port_of(conn_qual) == 0 {
            return Err(Error::arg(2));
        }
        listen(ia, conn_qual, evd, None).map(Psp)
    }

    /// Listen on a free connection qualifier (`dat_psp_create_any`).
    pub fn create_any(ia: &Ia, evd: &Evd) -> Result<Psp> {
        listen(ia, 0, evd, None).map(Psp)
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn conn_qual(&self) -> u64 {
        self.0.listener.port() as u64
    }

    pub fn evd(&self) -> &Evd {
        &self.0.evd
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }
}

impl Rsp {
    /// Listen on `conn_qual` for one request, for `ep` (which must be unconnected).
    pub fn create(ia: &Ia, conn_qual: u64, ep: &Ep, evd: &Evd) -> Result<Rsp> {
        if crate::port_of(conn_qual) == 0 {
            return Err(Error::arg(2));
        }
        if ep.state() != crate::EpState::Unconnected {
            return Err(Error::state(Minor::EpNotReady));
        }
        listen(ia, conn_qual, evd, Some(ep)).map(Rsp)
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn conn_qual(&self) -> u64 {
        self.0.listener.port() as u64
    }

    pub fn evd(&self) -> &Evd {
        &self.0.evd
    }

    pub fn ep(&self) -> &Ep {
        self.0.ep.as_ref().expect("an RSP has an endpoint")
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }
}

impl Drop for SpInner {
    fn drop(&mut self) {
        let mut sps = self.ia.0.sps.lock();
        let port = self.listener.port();
        if sps
            .get(&port)
            .is_some_and(|r| std::ptr::eq(r.sp.as_ptr(), self))
        {
            sps.remove(&port);
        }
        tracing::debug!(id = self.id, port, "service point freed");
    }
}

/// A connection request (`DAT_CR_HANDLE`): who asks, with what private data, at which
/// service point. Answer it once, with [`accept`](Cr::accept) or [`reject`](Cr::reject).
#[derive(Clone)]
pub struct Cr(pub(crate) Arc<CrInner>);

pub struct CrInner {
    id: u64,
    ia: Ia,
    cn_est_id: it::CnEstId,
    remote: Option<SocketAddr>,
    conn_qual: u64,
    private_data: Vec<u8>,
    /// The PSP (`psp: true`) or RSP the request arrived at, by id.
    sp_id: u64,
    psp: bool,
    /// The RSP's endpoint.
    rsp_ep: Option<Ep>,
    answered: AtomicBool,
    /// A UD service resolution (IB extension), for a UD endpoint.
    ud: bool,
}

impl Cr {
    /// The request a core connection-request event announces (`None` when its service
    /// point is gone: the request is rejected).
    pub(crate) fn arrived(ia: &Ia, r: it::ConnRequestEvent) -> Option<Cr> {
        let sp = ia.0.sps.lock().get(&r.port).and_then(|s| s.sp.upgrade());
        let Some(sp) = sp else {
            tracing::info!(
                port = r.port,
                "connection request for a freed service point: rejected"
            );
            let _ = r.cn_est_id.reject(&[]);
            return None;
        };
        Some(Cr(Arc::new(CrInner {
            id: next_id(),
            ia: ia.clone(),
            cn_est_id: r.cn_est_id,
            remote: r.source,
            conn_qual: r.port as u64,
            private_data: r.private_data,
            sp_id: sp.id,
            psp: sp.ep.is_none(),
            rsp_ep: sp.ep.clone(),
            answered: AtomicBool::new(false),
            ud: r.ud,
        })))
    }

    pub fn id(&self) -> u64 {
        self.0.id
    }

    pub fn ia(&self) -> &Ia {
        &self.0.ia
    }

    /// The requester's address (and port).
    pub fn remote(&self) -> Option<SocketAddr> {
        self.0.remote
    }

    pub fn conn_qual(&self) -> u64 {
        self.0.conn_qual
    }

    /// The requester's private data (over InfiniBand the REQ's whole field: the data,
    /// then zeros).
    pub fn private_data(&self) -> &[u8] {
        &self.0.private_data
    }

    /// A UD service resolution (answer it with a UD endpoint), not an RC connection.
    pub fn is_ud(&self) -> bool {
        self.0.ud
    }

    /// The service point's id, and whether it is a PSP (else an RSP).
    pub fn service_point(&self) -> (u64, bool) {
        (self.0.sp_id, self.0.psp)
    }

    /// The endpoint the service point offers (an RSP's).
    pub fn local_ep(&self) -> Option<&Ep> {
        self.0.rsp_ep.as_ref()
    }

    fn answer(&self) -> Result<()> {
        if self.0.answered.swap(true, Ordering::AcqRel) {
            return Err(Error::handle(Minor::HandleCr));
        }
        Ok(())
    }

    /// Accept on `ep` (an RSP's request: `None` takes its endpoint), answering with
    /// `private_data`. `Established` follows on the endpoint's connection EVD.
    pub fn accept(&self, ep: Option<&Ep>, private_data: &[u8]) -> Result<()> {
        let ep = ep
            .or(self.0.rsp_ep.as_ref())
            .ok_or(Error::handle(Minor::HandleEp))?;
        if ep.pz().ia().id() != self.0.ia.id() {
            return Err(Error::handle(Minor::HandleEp));
        }
        if ep.state() != crate::EpState::Unconnected {
            return Err(Error::state(Minor::EpNotReady));
        }
        let limit = self.0.ia.query().max_private_data.1;
        if private_data.len() > limit {
            return Err(Error::arg(3));
        }
        if ep.is_ud() != self.0.ud {
            return Err(Error::handle(Minor::HandleEp));
        }
        self.answer()?;
        ep.core()
            .accept(self.0.cn_est_id, private_data)
            .map_err(|e| match e {
                it::Error::InvalidCnEstId => Error::handle(Minor::HandleCr),
                other => other.into(),
            })
    }

    /// Reject, sending `private_data` to the requester (`PeerRejected` there).
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        let limit = self.0.ia.query().max_private_data.2;
        if private_data.len() > limit {
            return Err(Error::arg(2));
        }
        self.answer()?;
        self.0.cn_est_id.reject(private_data).map_err(|e| match e {
            it::Error::InvalidCnEstId => Error::handle(Minor::HandleCr),
            other => other.into(),
        })
    }

    /// Whether the request was accepted or rejected already.
    pub fn answered(&self) -> bool {
        self.0.answered.load(Ordering::Acquire)
    }
}

impl Drop for CrInner {
    fn drop(&mut self) {
        // A request nobody answered is rejected, so the requester is not left waiting.
        if !self.answered.load(Ordering::Acquire) {
            let _ = self.cn_est_id.reject(&[]);
        }
    }
}
