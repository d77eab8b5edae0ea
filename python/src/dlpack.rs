//! Arrays through DLPack: any object with `__dlpack__` and `__dlpack_device__` (torch tensors,
//! numpy arrays, CuPy, JAX) read as a typed, checked view: address, device, element type,
//! shape. The capsule is held (not consumed) while the view lives, so the producer's memory
//! stays alive and its own destructor runs when the view is dropped.
//!
//! CUDA arrays are exported with `stream=-1`: no synchronisation by the producer (the ops order
//! their work after the caller's stream themselves, `ops.rs`).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;
use std::ffi::c_void;

use crate::OpError;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// DLPack's device types tierkv reads.
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

/// DLPack's type codes.
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
/// `kDLFloat8_e4m3fn` (DLPack 1.1).
const DL_FLOAT8_E4M3FN: u8 = 10;

/// Where an array's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host memory (pageable or pinned).
    Cpu,
    /// GPU memory of the given ordinal.
    Cuda(i32),
}

/// The element type an argument must have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// Bytes: uint8, int8 or float8_e4m3fn (fp8 codes, raw cache bytes).
    Byte,
    /// bfloat16 (or a 16-bit integer view of bf16 bits).
    Bf16,
    F32,
    I32,
    /// Any element type of whole bytes (a cache whose blocks are read as raw bytes).
    Any,
}

impl Elem {
    fn accepts(self, code: u8, bits: u8) -> bool {
        match self {
            Elem::Byte => bits == 8 && matches!(code, DL_INT | DL_UINT | DL_FLOAT8_E4M3FN),
            Elem::Bf16 => bits == 16 && matches!(code, DL_BFLOAT | DL_INT | DL_UINT),
            Elem::F32 => bits == 32 && code == DL_FLOAT,
            Elem::I32 => bits == 32 && code == DL_INT,
            Elem::Any => bits > 0 && bits % 8 == 0,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Elem::Byte => "uint8, int8 or float8_e4m3fn",
            Elem::Bf16 => "bfloat16",
            Elem::F32 => "float32",
            Elem::I32 => "int32",
            Elem::Any => "a type of whole bytes",
        }
    }
}

/// A C-contiguous array read through DLPack, checked to have its argument's element type.
pub struct Arr<'py> {
    pub name: &'static str,
    /// The first element's address (the data pointer plus the byte offset).
    pub ptr: u64,
    pub device: Device,
    /// Bytes per element.
    pub elem_bytes: u64,
    pub shape: Vec<usize>,
    /// Holds the producer's memory alive.
    _capsule: Bound<'py, PyAny>,
}

fn err(op: &str, detail: String) -> PyErr {
    OpError::new_err(format!("tierkv.ops.{op}: {detail}"))
}

impl<'py> Arr<'py> {
    /// Reads `obj` (argument `name` of `op`) as an array of `elem`.
    pub fn read(
        op: &str,
        name: &'static str,
        obj: &Bound<'py, PyAny>,
        elem: Elem,
    ) -> PyResult<Self> {
        let capsule = export(op, name, obj)?;
        // SAFETY: a "dltensor" capsule holds a DLManagedTensor, whose first field is the
        // DLTensor; GetPointer checks the name (a versioned or used capsule answers null).
        let managed =
            unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) }
                as *const DlTensor;
        if managed.is_null() {
            // GetPointer set a Python error; this message replaces it.
            let _ = PyErr::take(obj.py());
            return Err(err(
                op,
                format!("`{name}`'s __dlpack__ gave no \"dltensor\" capsule"),
            ));
        }
        // SAFETY: non-null, and alive while `capsule` is (held in the result).
        let t = unsafe { &*managed };
        let device = match t.device.device_type {
            DL_CPU | DL_CUDA_HOST => Device::Cpu,
            DL_CUDA => Device::Cuda(t.device.device_id),
            other => {
                return Err(err(
                    op,
                    format!("`{name}` is on DLPack device type {other}, not CPU or CUDA"),
                ))
            }
        };
        if t.dtype.lanes != 1 || !elem.accepts(t.dtype.code, t.dtype.bits) {
            return Err(err(
                op,
                format!(
                    "`{name}` has DLPack type code {} of {} bits x {} lanes, not {}",
                    t.dtype.code,
                    t.dtype.bits,
                    t.dtype.lanes,
                    elem.name()
                ),
            ));
        }
        let shape = shape_of(op, name, t)?;
        let ptr = (t.data as u64)
            .checked_add(t.byte_offset)
            .ok_or_else(|| err(op, format!("`{name}`'s address overflows")))?;
        let elem_bytes = t.dtype.bits as u64 / 8;
        if ptr % elem_bytes != 0 {
            return Err(err(
                op,
                format!("`{name}` at {ptr:#x} is not aligned to its {elem_bytes}-byte elements"),
            ));
        }
        Ok(Arr {
            name,
            ptr,
            device,
            elem_bytes,
            shape,
            _capsule: capsule,
        })
    }

    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> u64 {
        self.len() as u64 * self.elem_bytes
    }

    /// Bytes per entry of the first dimension.
    pub fn row_bytes(&self) -> u64 {
        self.row_len() as u64 * self.elem_bytes
    }

    /// Elements per entry of the first dimension (1 for a 0- or 1-dimensional array).
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// The shape must be `want` exactly.
    pub fn expect_shape(&self, op: &str, want: &[usize]) -> PyResult<()> {
        if self.shape != want {
            return Err(err(
                op,
                format!(
                    "`{}` has shape {:?}, expected {:?}",
                    self.name, self.shape, want
                ),
            ));
        }
        Ok(())
    }

    /// The first dimension, for an array of `dims` dimensions.
    pub fn dims(&self, op: &str, dims: usize) -> PyResult<&[usize]> {
        if self.shape.len() != dims {
            return Err(err(
                op,
                format!(
                    "`{}` has {} dimensions ({:?}), expected {dims}",
                    self.name,
                    self.shape.len(),
                    self.shape
                ),
            ));
        }
        Ok(&self.shape)
    }

    /// The elements, for an array in host memory.
    ///
    /// # Safety
    /// Nothing else may write the array while the slice lives (the GIL is held and the ops run
    /// synchronously on the host).
    pub unsafe fn host<T: Copy>(&self) -> &[T] {
        assert_eq!(
            self.device,
            Device::Cpu,
            "{}: host() of a device array",
            self.name
        );
        assert_eq!(std::mem::size_of::<T>() as u64, self.elem_bytes);
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: a live, aligned, C-contiguous array of len() elements of this size.
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len()) }
    }

    /// The elements, writable, for an array in host memory.
    ///
    /// # Safety
    /// As [`Arr::host`], and the array must not alias another argument read meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn host_mut<T: Copy>(&self) -> &mut [T] {
        assert_eq!(
            self.device,
            Device::Cpu,
            "{}: host_mut() of a device array",
            self.name
        );
        assert_eq!(std::mem::size_of::<T>() as u64, self.elem_bytes);
        if self.len() == 0 {
            return &mut [];
        }
        // SAFETY: as `host`, and the caller guarantees no alias.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.len()) }
    }

    /// The array's bytes, for an array in host memory (any element type).
    ///
    /// # Safety
    /// As [`Arr::host`].
    pub unsafe fn host_bytes(&self) -> &[u8] {
        assert_eq!(
            self.device,
            Device::Cpu,
            "{}: host_bytes() of a device array",
            self.name
        );
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: as `host`.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.bytes() as usize) }
    }

    /// Whether this array's bytes and `other`'s share an address.
    pub fn overlaps(&self, other: &Arr) -> bool {
        self.device == other.device
            && self.bytes() > 0
            && other.bytes() > 0
            && self.ptr < other.ptr + other.bytes()
            && other.ptr < self.ptr + self.bytes()
    }

    /// The array's bytes, writable, for an array in host memory (any element type).
    ///
    /// # Safety
    /// As [`Arr::host_mut`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn host_bytes_mut(&self) -> &mut [u8] {
        assert_eq!(
            self.device,
            Device::Cpu,
            "{}: host_bytes_mut() of a device array",
            self.name
        );
        if self.len() == 0 {
            return &mut [];
        }
        // SAFETY: as `host_mut`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.bytes() as usize) }
    }
}

/// torch's C export of a tensor's DLPack capsule (`torch.utils.dlpack.to_dlpack`).
static TORCH_TO_DLPACK: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `obj`'s DLPack capsule, without synchronisation for a CUDA array: a `torch.Tensor` through
/// `torch.utils.dlpack.to_dlpack` (the capsule `Tensor.__dlpack__` returns, without its
/// Python-level checks, which cost about 10 us a tensor with `__dlpack_device__`), any other
/// array through `__dlpack__` (`stream=-1` for a CUDA one).
fn export<'py>(op: &str, name: &str, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let not_array = |e: PyErr| err(op, format!("`{name}` is not a DLPack array ({e})"));
    let ty = obj.get_type();
    if ty.name().is_ok_and(|n| n == "Tensor") && ty.module().is_ok_and(|m| m == "torch") {
        let py = obj.py();
        let to_dlpack = TORCH_TO_DLPACK.get_or_try_init(py, || {
            py.import("torch.utils.dlpack")?
                .getattr("to_dlpack")
                .map(Bound::unbind)
        })?;
        return to_dlpack.bind(py).call1((obj,)).map_err(not_array);
    }
    let (dev_type, _id): (i32, i32) = obj
        .call_method0("__dlpack_device__")
        .and_then(|d| d.extract())
        .map_err(not_array)?;
    if dev_type == DL_CUDA {
        let kw = PyDict::new(obj.py());
        kw.set_item("stream", -1)?;
        obj.call_method("__dlpack__", (), Some(&kw))
    } else {
        obj.call_method0("__dlpack__")
    }
    .map_err(not_array)
}

/// The shape of a DLPack tensor, checked to be C-contiguous.
fn shape_of(op: &str, name: &str, t: &DlTensor) -> PyResult<Vec<usize>> {
    let ndim = usize::try_from(t.ndim)
        .map_err(|_| err(op, format!("`{name}` has {} dimensions", t.ndim)))?;
    if ndim == 0 {
        // A scalar: its shape pointer may be null.
        return Ok(Vec::new());
    }
    // SAFETY: DLPack's shape (and strides, when not null) hold `ndim` entries.
    let shape_raw = unsafe { std::slice::from_raw_parts(t.shape, ndim) };
    let shape: Vec<usize> = shape_raw.iter().map(|&d| d.max(0) as usize).collect();
    // An empty array has no element to misplace (numpy gives its dimensions any stride).
    if !t.strides.is_null() && !shape.contains(&0) {
        // SAFETY: as above.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        check_contiguous(op, name, &shape, strides)?;
    }
    Ok(shape)
}

/// C-contiguous, in elements; a dimension of extent 1 may have any stride (torch and numpy give
/// such dimensions arbitrary strides).
fn check_contiguous(op: &str, name: &str, shape: &[usize], strides: &[i64]) -> PyResult<()> {
    let mut want: i64 = 1;
    for (d, (&n, &s)) in shape.iter().zip(strides).enumerate().rev() {
        if n != 1 && s != want {
            return Err(err(
                op,
                format!(
                "`{name}` is not C-contiguous (dimension {d} has stride {s}, expected {want}); \
                 pass .contiguous()"
            ),
            ));
        }
        want = want.saturating_mul(n as i64);
    }
    Ok(())
}
