//! The `launch` module of a build without the `cuda` feature (candle's dummy-backend habit): the
//! entry points that hand out the kernels (`Kernels::global`, `Kernels::on`) answer
//! [`KernelError::BuiltWithoutCuda`], so that a caller asks for a GPU the same way in every
//! build and gets a typed refusal instead of a `cfg` branch of its own. Every launch is a method
//! of `Kernels`, which cannot exist in this build (an uninhabited field): the launchers, and the
//! other items of the real module (`LogitsKernel`, `DevPtr`, ...), are not here.
//!
//! [`KernelError::BuiltWithoutCuda`]: crate::KernelError::BuiltWithoutCuda

use crate::error::Result;

/// No value: a build without CUDA has no kernels to hand out.
#[derive(Debug)]
enum Absent {}

/// The kernels on a GPU: never made in this build.
#[derive(Debug)]
pub struct Kernels {
    absent: Absent,
}

impl Kernels {
    /// Answers [`KernelError::BuiltWithoutCuda`](crate::KernelError::BuiltWithoutCuda).
    pub fn global() -> Result<&'static Kernels> {
        Err(super::built_without_cuda("Kernels::global"))
    }

    /// Answers [`KernelError::BuiltWithoutCuda`](crate::KernelError::BuiltWithoutCuda), for any
    /// device.
    pub fn on(_ordinal: usize) -> Result<&'static Kernels> {
        Err(super::built_without_cuda("Kernels::on"))
    }

    /// Any value at all, since no `Kernels` exists in this build (for code that holds one on a
    /// path only a CUDA build reaches).
    pub fn unreachable<T>(&self) -> T {
        match self.absent {}
    }
}
