//! MPI_Alloc_mem: memory registered with the NIC, so windows over it take atomics (which the
//! NIC applies only to memory it maps), and messages sent from or received into it move
//! without the kernel copies that reach other process memory.

use std::cell::RefCell;
use std::rc::Rc;

use crate::client::MemRegion;
use crate::nic::memory::Perms;

use super::comm::Comm;
use super::error::MpiError;
use super::state::{AllocRange, State};

/// Memory from [`Comm::alloc_mem`] (MPI_Alloc_mem), zeroed. Clones share it; it is freed
/// (MPI_Free_mem) when the last clone goes, so a window or attachment over it keeps it alive.
#[derive(Clone)]
pub struct AllocMem {
    inner: Rc<Inner>,
}

struct Inner {
    region: MemRegion,
    len: usize,
    st: Rc<RefCell<State>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(mut st) = self.st.try_borrow_mut() {
            let start = self.region.as_ptr() as u64;
            if let Some(i) = st.alloc.iter().position(|a| a.start == start) {
                let a = st.alloc.swap_remove(i);
                if let Some(md) = a.md {
                    let ni = st.ni;
                    let _ = st.p.md_release(ni, md);
                }
            }
            let _ = st.p.endpoint().mem_deregister(&self.region);
        }
    }
}

impl AllocMem {
    /// The bytes. Remote operations change them within the epochs the program's
    /// synchronisation allows, as with any window memory.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes(&self) -> &mut [u8] {
        &mut self.inner.region.bytes()[..self.inner.len]
    }

    pub fn len(&self) -> usize {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// MPI_Get_address of the first byte: what a dynamic window's displacements name.
    pub fn address(&self) -> u64 {
        self.inner.region.as_ptr() as u64
    }

    pub(super) fn region(&self) -> &MemRegion {
        &self.inner.region
    }

    /// Whether `a` and `b` are the same allocation.
    pub(super) fn same(a: &AllocMem, b: &AllocMem) -> bool {
        Rc::ptr_eq(&a.inner, &b.inner)
    }
}

impl Comm {
    /// MPI_Alloc_mem: `len` bytes registered with this rank's NIC (any communicator of the
    /// job serves; MPI's call takes none).
    pub fn alloc_mem(&self, len: usize) -> Result<AllocMem, MpiError> {
        let mut st = self.st.borrow_mut();
        let region =
            st.p.endpoint()
                .mem_register(len.max(8), Perms::READ_WRITE)?;
        let start = region.as_ptr() as u64;
        st.alloc.push(AllocRange {
            start,
            end: start + len as u64,
            region: region.handle,
            md: None,
        });
        drop(st);
        Ok(AllocMem {
            inner: Rc::new(Inner {
                region,
                len,
                st: self.st.clone(),
            }),
        })
    }
}
