//! Where a split's samples live while training (device.data), and how a batch is assembled
//! from them: gathered on the device from a data set uploaded once, or, when the data set
//! does not fit beside the training, gathered on the host and copied (pinned memory,
//! asynchronously, on a GPU).

use crate::data::{Data, DataReads, Dataset, TokenIds};
use crate::error::Result;
use crate::graph::Network;
use crate::ops::Engine;
use crate::spec::DataPlacement;
use crate::tensor::{HostIds, IdsInto, RowsAt};

/// A step's samples: `rows` in micro-batches of `size` (the last may be smaller).
#[derive(Debug, Clone, Copy)]
pub struct MicroBatches<'a> {
    pub rows: &'a [u64],
    pub size: usize,
}

impl<'a> MicroBatches<'a> {
    pub fn iter(self) -> std::slice::Chunks<'a, u64> {
        self.rows.chunks(self.size)
    }
}

/// A split's samples, and where each one's inputs and targets lie in them.
pub struct Samples<B: Engine> {
    /// The data's values, where a layer reads them.
    values: Option<Held<B::Buf, Vec<f32>>>,
    /// Value data's token ids, where an embedding reads them (a text's are its targets').
    ids: Option<Held<B::Ids, Vec<u32>>>,
    targets: Targets<B>,
    /// Whether the network reads token ids.
    feeds_ids: bool,
    inputs: RowsAt,
    targets_at: RowsAt,
}

/// Where a sample's targets are.
enum Targets<B: Engine> {
    /// Rows of values.
    Rows(Held<B::Buf, Vec<f32>>),
    /// A text's tokens: the targets are the tokens one on, and the inputs are these ids.
    NextTokens(Held<B::Ids, TokenIds>),
}

/// A data set on the device (`D`), where a batch is a gather, or in host memory (`S`),
/// where a batch is gathered and copied.
enum Held<D, S> {
    Resident(D),
    Streamed(S),
}

impl<D, S> Held<D, S> {
    fn new(data: S, resident: bool, upload: impl FnOnce(S) -> Result<D>) -> Result<Self> {
        Ok(match resident {
            true => Held::Resident(upload(data)?),
            false => Held::Streamed(data),
        })
    }
}

impl<D, S: HostIds> Held<D, S> {
    fn as_ids(&self) -> Held<&D, &dyn HostIds> {
        match self {
            Held::Resident(d) => Held::Resident(d),
            Held::Streamed(s) => Held::Streamed(s),
        }
    }
}

impl<B: Engine> Samples<B> {
    /// `set`'s samples of `row_len` input values and `target_dim` targets each, kept as the
    /// network `reads` them: values, token ids, or both (converted once, here).
    pub fn new(
        backend: &B,
        set: Dataset,
        (row_len, target_dim): (usize, usize),
        reads: DataReads,
        resident: bool,
    ) -> Result<Self> {
        let Dataset {
            features,
            tokens,
            targets,
            windows,
            ..
        } = set;
        let (inputs, targets_at) = match windows {
            // Windows of tokens `stride` apart; the targets are the next tokens.
            Some(stride) => {
                let at = |offset| RowsAt {
                    len: row_len,
                    stride,
                    offset,
                };
                (at(0), at(1))
            }
            None => (RowsAt::packed(row_len), RowsAt::packed(target_dim)),
        };
        let text = windows.is_some();
        // Value data's ids were checked to be whole numbers in [0, vocab) when loaded.
        let ids = (reads.ids && !text).then(|| features.iter().map(|&v| v as u32).collect());
        let values = match (reads.values, text) {
            (false, _) => None,
            (true, false) => Some(features),
            (true, true) => Some(tokens.to_vec()?.into_iter().map(|id| id as f32).collect()),
        };
        let values = values.map(|v| Held::new(v, resident, |v| backend.upload_vec(v)));
        let ids = ids.map(|v| Held::new(v, resident, |v| backend.upload_ids(v)));
        let targets = match text {
            true => {
                let upload = |t: TokenIds| backend.upload_ids(t.into_vec()?);
                Targets::NextTokens(Held::new(tokens, resident, upload)?)
            }
            false => Targets::Rows(Held::new(targets, resident, |v| backend.upload_vec(v))?),
        };
        Ok(Samples {
            values: values.transpose()?,
            ids: ids.transpose()?,
            targets,
            feeds_ids: reads.ids,
            inputs,
            targets_at,
        })
    }

    /// Whether every batch so far read its samples: token files read where they lie may
    /// have changed under the run (`TokenIds::check_reads`).
    pub fn check_reads(&self) -> Result<()> {
        match &self.targets {
            Targets::NextTokens(Held::Streamed(tokens)) => tokens.check_reads(),
            _ => Ok(()),
        }
    }

    /// Puts the samples `rows` into the network's input and target buffers. A read that
    /// fails shows in `check_reads`.
    pub fn load(&self, backend: &B, rows: &[u64], net: &mut Network<B>) {
        let (inputs, targets_at) = (self.inputs, self.targets_at);
        match &self.values {
            Some(Held::Resident(x)) => backend.gather_rows(x, rows, inputs, net.input_mut()),
            Some(Held::Streamed(x)) => backend.upload_rows(x, rows, inputs, net.input_mut()),
            None => {}
        }
        let ids = match &self.targets {
            Targets::NextTokens(tokens) => Some(tokens.as_ids()),
            Targets::Rows(_) => self.ids.as_ref().map(Held::as_ids),
        };
        match ids.filter(|_| self.feeds_ids) {
            Some(Held::Resident(ids)) => {
                backend.gather_ids(ids, rows, inputs, IdsInto::Ids(net.ids_mut()))
            }
            Some(Held::Streamed(ids)) => {
                backend.upload_id_rows(ids, rows, inputs, IdsInto::Ids(net.ids_mut()))
            }
            None => {}
        }
        let targets = net.targets_mut();
        match &self.targets {
            Targets::Rows(Held::Resident(y)) => backend.gather_rows(y, rows, targets_at, targets),
            Targets::Rows(Held::Streamed(y)) => backend.upload_rows(y, rows, targets_at, targets),
            Targets::NextTokens(Held::Resident(tokens)) => {
                backend.gather_ids(tokens, rows, targets_at, IdsInto::Values(targets))
            }
            Targets::NextTokens(Held::Streamed(tokens)) => {
                backend.upload_id_rows(tokens, rows, targets_at, IdsInto::Values(targets))
            }
        }
    }
}

/// What "auto" keeps free beside the data set: 10% of the free memory and 256 MiB, for the
/// scratch that grows during the first steps.
fn on_device_margin(free: usize) -> usize {
    free / 10 + (256 << 20)
}

/// Whether a data set of `bytes` stays on a device with `free` bytes free (device.data =
/// "auto"); `trainer check` predicts with it too.
pub fn fits_on_device(bytes: usize, free: usize) -> bool {
    bytes + on_device_margin(free) <= free
}

/// Whether the data set (`bytes` of `data`) is uploaded whole, as `asked`. "auto" uploads it
/// when it fits in the device memory still free, with a margin for the scratch that grows
/// during the first steps, and leaves token files where they lie (`Data::placement`); call
/// it after the network and the optimizer have their memory.
pub fn resident<B: Engine>(backend: &B, asked: DataPlacement, data: &Data, bytes: usize) -> bool {
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    match data.placement(asked) {
        DataPlacement::Resident => true,
        DataPlacement::Streamed => {
            let why = match asked {
                DataPlacement::Streamed => "device.data = \"streamed\"",
                _ => "token files stay where they lie",
            };
            if backend.free_memory().is_some() {
                tracing::info!("data: streamed from pinned host memory ({why})");
            }
            false
        }
        DataPlacement::Auto => {
            let Some(free) = backend.free_memory() else {
                return true; // the CPU: host memory is the device's
            };
            let (fits, margin) = (fits_on_device(bytes, free), on_device_margin(free));
            if !fits {
                tracing::info!(
                    "data: streamed from pinned host memory: the data set ({:.0} MiB) does not \
                     fit in the {:.0} MiB of device memory free beside the training (with a \
                     {:.0} MiB margin)",
                    mib(bytes),
                    mib(free),
                    mib(margin)
                );
            }
            fits
        }
    }
}
