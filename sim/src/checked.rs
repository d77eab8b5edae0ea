//! The oracles on the in-order CPU device: a `Device` wrapper that runs the content oracle on every
//! op just before the in-order device runs it (in-order, enqueue is execution, so the bytes it
//! checks are the bytes the op reads). For the engine's scenario tests, where the simulated GPU's
//! interleavings are not wanted but the content oracle must still judge the rows the kernels
//! read.

use crate::oracles::content::{ContentOracle, PageState};
use std::cell::RefCell;
use std::rc::Rc;
use tierkv_engine::cpu_device::InOrderDevice;
use tierkv_engine::device::*;
use tierkv_engine::layout::Bytes;

pub struct CheckedInOrder {
    pub inner: InOrderDevice,
    pub content: Rc<RefCell<ContentOracle>>,
    pub findings: Vec<String>,
}

struct NoTaint;
impl PageState for NoTaint {
    fn tainted_rows(&self, _: BufferId, _: u64) -> u64 {
        0
    }
    fn generation(&self, _: BufferId, _: u64) -> u64 {
        // No cache: every read is compared in full.
        u64::MAX
    }
}

impl CheckedInOrder {
    pub fn new(content: Rc<RefCell<ContentOracle>>) -> Self {
        CheckedInOrder {
            inner: InOrderDevice::new(),
            content,
            findings: Vec::new(),
        }
    }
}

impl Device for CheckedInOrder {
    fn alloc(&mut self, desc: BufferDesc) -> Result<BufferId, DeviceError> {
        self.inner.alloc(desc)
    }
    fn desc(&self, buf: BufferId) -> BufferDesc {
        self.inner.desc(buf)
    }
    fn new_event(&mut self) -> Result<EventId, DeviceError> {
        self.inner.new_event()
    }
    fn record(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.inner.record(stream, ev)
    }
    fn wait(&mut self, stream: StreamKind, ev: EventId) -> Result<(), DeviceError> {
        self.inner.wait(stream, ev)
    }
    fn query(&mut self, ev: EventId) -> EventState {
        self.inner.query(ev)
    }
    fn synchronize(&mut self, ev: EventId) -> EventState {
        self.inner.synchronize(ev)
    }
    fn enqueue(&mut self, stream: StreamKind, op: Op) -> Result<(), DeviceError> {
        check_op(&op, |b| self.inner.desc(b))?;
        let found = self
            .content
            .borrow_mut()
            .check_reads(&op, &self.inner.mem, &NoTaint);
        self.findings.extend(
            found
                .into_iter()
                .map(|(oracle, m)| format!("[{oracle}] {m}")),
        );
        self.inner.enqueue(stream, op)
    }
    fn host_read(
        &mut self,
        buf: BufferId,
        offset: Bytes,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        self.inner.host_read(buf, offset, out)
    }
    fn host_write(&mut self, buf: BufferId, offset: Bytes, data: &[u8]) -> Result<(), DeviceError> {
        self.inner.host_write(buf, offset, data)
    }
    fn recover(&mut self) -> Result<(), DeviceError> {
        self.inner.recover()
    }
    fn context_generation(&self) -> u64 {
        self.inner.context_generation()
    }
    fn take_timing(&mut self) -> Option<tierkv_engine::device::DeviceTiming> {
        self.inner.take_timing()
    }
}
