//! The host tier's side of a server's transfers: the caches a server registers, checked against
//! the page formats it says its layers use, and each transfer job turned into coalesced copy
//! runs between the server's device pages and tierkv's host chunks — every address checked to
//! lie inside a registered cache before anything is copied.
//!
//! The shapes are vLLM's (0.34): a server registers its caches as tensors of `blocks` pages of
//! `page_bytes` each (the stride between pages), and KV groups whose layers each reference one
//! tensor and copy `ref_bytes` of each page (the page without its padding). A job names, per
//! group, its device pages as addresses (for each layer reference, for each block) and the host
//! chunks they go to or come from; a host chunk holds `blocks_per_chunk` consecutive blocks, and
//! a group's first block may start inside its first chunk (`block_index % blocks_per_chunk`).
//!
//! Host memory is laid out per registered tensor: chunk `c`'s block `b` of tensor `t` is at
//! `c * page_bytes(t) * blocks_per_chunk + b * page_bytes(t)` in tensor `t`'s host buffer.

use std::fmt;

use tierkv_kernels::layout::{IndexKDtype, KvDtype, PageFormat};

/// A registered cache tensor: `blocks` pages of `page_bytes` bytes from device address `base`,
/// `stride` bytes apart (more than `page_bytes` where a server interleaves layers in a block).
/// Its host chunks hold `page_bytes` a block, without the gaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheTensor {
    pub base: u64,
    pub blocks: u64,
    pub page_bytes: u64,
    pub stride: u64,
}

/// One layer's reference into a registered tensor, and the bytes of each page it copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerRef {
    pub tensor: usize,
    pub ref_bytes: u64,
}

/// A KV group as registered: its tokens per block and its layers' references.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub tokens_per_block: u64,
    pub refs: Vec<LayerRef>,
}

/// The most bytes a host tier may hold in all (1 PiB): a larger request is a typo, not a server.
pub const HOST_BYTES_MAX: u64 = 1 << 50;

/// A registration refused, naming the group and layer reference where one is at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("no page formats given: name the formats the model's layers use (e.g. kv/fp8_packed, index_k/fp8)")]
    NoFormats,
    #[error("unknown page format {0:?}: expected one of {1}")]
    UnknownFormat(String, String),
    #[error("format {0} is configured twice")]
    RepeatedFormat(String),
    #[error("no cache tensors registered")]
    NoTensors,
    #[error("no KV groups registered")]
    NoGroups,
    #[error("cache tensor {tensor}: {what}")]
    Tensor { tensor: usize, what: String },
    #[error("group {group}: {what}")]
    Group { group: usize, what: String },
    #[error(
        "group {group}, layer reference {layer}: {ref_bytes} bytes per page, but {tokens} tokens \
         of {formats} are {expected} bytes: the cache's layout is not the configured one \
         (a host tier sized for the configured pages would cut or overrun these)"
    )]
    Layout {
        group: usize,
        layer: usize,
        ref_bytes: u64,
        tokens: u64,
        formats: String,
        expected: String,
    },
    #[error("format {format} is configured but no layer's pages have its size ({bytes} bytes at {tokens} tokens a block): its cache would never be offloaded")]
    FormatUnused {
        format: String,
        bytes: String,
        tokens: String,
    },
    #[error("blocks_per_chunk is 0")]
    NoBlocksPerChunk,
    #[error("the host tier would hold {0} bytes or more, above the {max} accepted", max = HOST_BYTES_MAX)]
    HostTooLarge(u64),
}

/// A transfer job refused: nothing of it was copied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("job names {got} groups, the registration has {want}")]
    Groups { got: usize, want: usize },
    #[error("group {group}: the job gives {got} layer references, the registration has {want}")]
    Refs { group: usize, got: u64, want: usize },
    #[error("the job has {ptrs} device addresses and {sizes} sizes, its groups need {need}")]
    Addresses {
        ptrs: usize,
        sizes: usize,
        need: u64,
    },
    #[error("group {group}, layer reference {layer}, block {block}: size {size}, the reference copies {want} bytes a page")]
    Size {
        group: usize,
        layer: usize,
        block: u64,
        size: u64,
        want: u64,
    },
    #[error("group {group}, layer reference {layer}, block {block}: address {addr:#x} is not the start of a page of cache tensor {tensor} ({blocks} pages {stride} bytes apart from {base:#x})")]
    Address {
        group: usize,
        layer: usize,
        block: u64,
        addr: u64,
        tensor: usize,
        base: u64,
        blocks: u64,
        stride: u64,
    },
    #[error("the job's groups need {need} host chunks, it names {got}")]
    Chunks { need: u64, got: usize },
    #[error("host chunk {chunk} is out of range (the tier has {chunks})")]
    Chunk { chunk: u64, chunks: u64 },
}

/// One copy between a device range and a host range of the same tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub tensor: usize,
    pub device: u64,
    /// Offset in tensor `tensor`'s host buffer.
    pub host: u64,
    pub bytes: u64,
}

/// A job's copies, coalesced: consecutive pages contiguous on both sides make one run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub runs: Vec<Run>,
    /// Bytes copied in all.
    pub bytes: u64,
    /// Page copies before coalescing.
    pub pages: u64,
}

/// A job as vLLM hands it over (`DevicePointers` and the host side's chunk numbers).
#[derive(Clone, Copy, Debug)]
pub struct Job<'a> {
    pub ptrs: &'a [u64],
    pub sizes: &'a [u64],
    pub group_blocks: &'a [u64],
    pub group_refs: &'a [u64],
    pub block_indices: &'a [u64],
    pub chunks: &'a [u64],
}

/// A checked registration.
#[derive(Clone, Debug)]
pub struct Registration {
    tensors: Vec<CacheTensor>,
    groups: Vec<Group>,
    blocks_per_chunk: u64,
    chunks: u64,
}

/// Every page format tierkv knows, by its name (`kv/fp8_packed`, `index_k/fp8`, ...).
pub fn format_names() -> Vec<String> {
    all_formats().iter().map(|f| f.to_string()).collect()
}

fn all_formats() -> Vec<PageFormat> {
    let mut v: Vec<PageFormat> = KvDtype::ALL.iter().map(|&d| PageFormat::Kv(d)).collect();
    v.push(PageFormat::Kv(KvDtype::Fp8Unpacked));
    v.extend(IndexKDtype::ALL.iter().map(|&d| PageFormat::IndexK(d)));
    v
}

/// Parses a page format's name as [`PageFormat`]'s `Display` writes it.
pub fn parse_format(name: &str) -> Result<PageFormat, RegisterError> {
    all_formats()
        .into_iter()
        .find(|f| f.to_string() == name)
        .ok_or_else(|| RegisterError::UnknownFormat(name.to_string(), format_names().join(", ")))
}

struct Listed<'a>(&'a [PageFormat]);
impl fmt::Display for Listed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, x) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" or ")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

impl Registration {
    /// Checks a server's caches: every tensor non-empty with pages of at least the bytes its
    /// references copy, every reference's page bytes those of `tokens_per_block` tokens of one
    /// of `formats`, every format used by some reference, and the host tier's size in range.
    pub fn new(
        tensors: Vec<CacheTensor>,
        groups: Vec<Group>,
        formats: &[PageFormat],
        blocks_per_chunk: u64,
        chunks: u64,
    ) -> Result<Self, RegisterError> {
        if formats.is_empty() {
            return Err(RegisterError::NoFormats);
        }
        if let Some(i) = (1..formats.len()).find(|&i| formats[..i].contains(&formats[i])) {
            return Err(RegisterError::RepeatedFormat(formats[i].to_string()));
        }
        if tensors.is_empty() {
            return Err(RegisterError::NoTensors);
        }
        if groups.is_empty() {
            return Err(RegisterError::NoGroups);
        }
        if blocks_per_chunk == 0 {
            return Err(RegisterError::NoBlocksPerChunk);
        }
        for (i, t) in tensors.iter().enumerate() {
            if let Some(what) = tensor_fault(t) {
                return Err(RegisterError::Tensor { tensor: i, what });
            }
        }
        let mut used = vec![false; formats.len()];
        for (g, group) in groups.iter().enumerate() {
            check_group(g, group, &tensors, formats, &mut used)?;
        }
        if let Some(i) = used.iter().position(|u| !u) {
            let sizes = |f: &dyn Fn(&Group) -> u64| -> String {
                let v: Vec<String> = groups.iter().map(|g| f(g).to_string()).collect();
                v.join(" or ")
            };
            return Err(RegisterError::FormatUnused {
                format: formats[i].to_string(),
                bytes: sizes(&|g| {
                    formats[i]
                        .rows_bytes(g.tokens_per_block)
                        .unwrap_or(u64::MAX)
                }),
                tokens: sizes(&|g| g.tokens_per_block),
            });
        }
        let reg = Registration {
            tensors,
            groups,
            blocks_per_chunk,
            chunks,
        };
        let total = (0..reg.tensors.len()).fold(0u64, |sum, t| {
            sum.saturating_add(reg.host_bytes_checked(t).unwrap_or(u64::MAX))
        });
        if total > HOST_BYTES_MAX {
            return Err(RegisterError::HostTooLarge(total));
        }
        Ok(reg)
    }

    pub fn tensors(&self) -> &[CacheTensor] {
        &self.tensors
    }

    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    /// Bytes of one host chunk of tensor `t`.
    pub fn chunk_bytes(&self, t: usize) -> u64 {
        self.tensors[t].page_bytes * self.blocks_per_chunk
    }

    fn host_bytes_checked(&self, t: usize) -> Option<u64> {
        self.tensors[t]
            .page_bytes
            .checked_mul(self.blocks_per_chunk)?
            .checked_mul(self.chunks)
    }

    /// Bytes of tensor `t`'s host buffer (checked at registration to fit).
    pub fn host_bytes(&self, t: usize) -> u64 {
        self.host_bytes_checked(t).expect("checked at registration")
    }

    /// Turns a job into checked, coalesced runs. Nothing is copied here.
    pub fn plan(&self, job: &Job<'_>) -> Result<Plan, PlanError> {
        self.check_shape(job)?;
        let mut plan = Plan::default();
        let mut op = 0usize;
        let mut chunk_at = 0usize;
        for (g, group) in self.groups.iter().enumerate() {
            let blocks = job.group_blocks[g];
            if blocks == 0 {
                continue;
            }
            let skip = job.block_indices[g] % self.blocks_per_chunk;
            let chunks = &job.chunks[chunk_at..];
            for (l, r) in group.refs.iter().enumerate() {
                for b in 0..blocks {
                    let at = Page {
                        group: g,
                        layer: l,
                        block: b,
                    };
                    let host = |slot: u64| {
                        let chunk = chunks[(slot / self.blocks_per_chunk) as usize];
                        chunk * self.chunk_bytes(r.tensor)
                            + (slot % self.blocks_per_chunk) * self.tensors[r.tensor].page_bytes
                    };
                    let run = self.page_run(at, r, job.ptrs[op], job.sizes[op], host(skip + b))?;
                    plan.push(run);
                    op += 1;
                }
            }
            chunk_at += blocks.saturating_add(skip).div_ceil(self.blocks_per_chunk) as usize;
        }
        debug_assert_eq!(op, job.ptrs.len());
        Ok(plan)
    }

    /// Checks a job's counts against the registration: its groups, layer references, addresses
    /// and chunks (each chunk in range).
    fn check_shape(&self, job: &Job<'_>) -> Result<(), PlanError> {
        let n = self.groups.len();
        if job.group_blocks.len() != n || job.group_refs.len() != n || job.block_indices.len() != n
        {
            let got = job
                .group_blocks
                .len()
                .max(job.group_refs.len())
                .max(job.block_indices.len());
            return Err(PlanError::Groups { got, want: n });
        }
        let mut need: u64 = 0;
        let mut need_chunks: u64 = 0;
        for g in 0..n {
            let blocks = job.group_blocks[g];
            if blocks == 0 {
                continue;
            }
            if job.group_refs[g] != self.groups[g].refs.len() as u64 {
                return Err(PlanError::Refs {
                    group: g,
                    got: job.group_refs[g],
                    want: self.groups[g].refs.len(),
                });
            }
            need = need.saturating_add(blocks.saturating_mul(job.group_refs[g]));
            let skip = job.block_indices[g] % self.blocks_per_chunk;
            need_chunks = need_chunks
                .saturating_add(blocks.saturating_add(skip).div_ceil(self.blocks_per_chunk));
        }
        if job.ptrs.len() as u64 != need || job.sizes.len() as u64 != need {
            let (ptrs, sizes) = (job.ptrs.len(), job.sizes.len());
            return Err(PlanError::Addresses { ptrs, sizes, need });
        }
        if job.chunks.len() as u64 != need_chunks {
            let got = job.chunks.len();
            return Err(PlanError::Chunks {
                need: need_chunks,
                got,
            });
        }
        match job.chunks.iter().find(|&&c| c >= self.chunks) {
            Some(&chunk) => Err(PlanError::Chunk {
                chunk,
                chunks: self.chunks,
            }),
            None => Ok(()),
        }
    }

    /// One page's copy, its size and address checked against reference `r`'s tensor.
    fn page_run(
        &self,
        at: Page,
        r: &LayerRef,
        addr: u64,
        size: u64,
        host: u64,
    ) -> Result<Run, PlanError> {
        let Page {
            group,
            layer,
            block,
        } = at;
        if size != r.ref_bytes {
            let want = r.ref_bytes;
            return Err(PlanError::Size {
                group,
                layer,
                block,
                size,
                want,
            });
        }
        let t = &self.tensors[r.tensor];
        let off = addr.wrapping_sub(t.base);
        if addr < t.base || off % t.stride != 0 || off / t.stride >= t.blocks {
            return Err(PlanError::Address {
                group,
                layer,
                block,
                addr,
                tensor: r.tensor,
                base: t.base,
                blocks: t.blocks,
                stride: t.stride,
            });
        }
        Ok(Run {
            tensor: r.tensor,
            device: addr,
            host,
            bytes: size,
        })
    }
}

/// Where a page copy is in its job: the group, the layer reference and the block.
#[derive(Clone, Copy)]
struct Page {
    group: usize,
    layer: usize,
    block: u64,
}

/// What is wrong with a registered tensor, if anything.
fn tensor_fault(t: &CacheTensor) -> Option<String> {
    if t.blocks == 0 {
        Some("no pages".to_string())
    } else if t.page_bytes == 0 {
        Some("pages of 0 bytes".to_string())
    } else if t.stride < t.page_bytes {
        Some(format!(
            "pages of {} bytes only {} bytes apart",
            t.page_bytes, t.stride
        ))
    } else if t
        .blocks
        .checked_mul(t.stride)
        .and_then(|b| t.base.checked_add(b))
        .is_none()
    {
        Some(format!(
            "{} pages {} bytes apart from {:#x} overflow the address space",
            t.blocks, t.stride, t.base
        ))
    } else {
        None
    }
}

/// Checks group `g`'s references, marking in `used` the formats they match.
fn check_group(
    g: usize,
    group: &Group,
    tensors: &[CacheTensor],
    formats: &[PageFormat],
    used: &mut [bool],
) -> Result<(), RegisterError> {
    let fault = |what: String| RegisterError::Group { group: g, what };
    if group.refs.is_empty() {
        return Err(fault("no layer references".into()));
    }
    if group.tokens_per_block == 0 {
        return Err(fault("0 tokens per block".into()));
    }
    for (l, r) in group.refs.iter().enumerate() {
        let Some(t) = tensors.get(r.tensor) else {
            return Err(fault(format!(
                "layer reference {l} names tensor {}, only {} are registered",
                r.tensor,
                tensors.len()
            )));
        };
        if r.ref_bytes == 0 || r.ref_bytes > t.page_bytes {
            return Err(fault(format!(
                "layer reference {l} copies {} bytes of tensor {}'s {}-byte pages",
                r.ref_bytes, r.tensor, t.page_bytes
            )));
        }
        let bytes_of = |f: &PageFormat| f.rows_bytes(group.tokens_per_block);
        match formats
            .iter()
            .position(|f| bytes_of(f) == Some(r.ref_bytes))
        {
            Some(i) => used[i] = true,
            None => {
                let expected: Vec<String> = formats
                    .iter()
                    .map(|f| bytes_of(f).unwrap_or(u64::MAX).to_string())
                    .collect();
                return Err(RegisterError::Layout {
                    group: g,
                    layer: l,
                    ref_bytes: r.ref_bytes,
                    tokens: group.tokens_per_block,
                    formats: Listed(formats).to_string(),
                    expected: expected.join(" or "),
                });
            }
        }
    }
    Ok(())
}

impl Plan {
    fn push(&mut self, run: Run) {
        self.bytes += run.bytes;
        self.pages += 1;
        if let Some(last) = self.runs.last_mut() {
            if last.tensor == run.tensor
                && last.device + last.bytes == run.device
                && last.host + last.bytes == run.host
            {
                last.bytes += run.bytes;
                return;
            }
        }
        self.runs.push(run);
    }
}

#[cfg(test)]
mod tests;
