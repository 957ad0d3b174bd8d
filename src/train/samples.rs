//! Where a split's samples live while training (device.data), and how a batch is assembled
//! from them: gathered on the device from a data set uploaded once, or, when the data set
//! does not fit beside the training, gathered on the host and copied (pinned memory,
//! asynchronously, on a GPU).

use crate::data::Dataset;
use crate::error::Result;
use crate::graph::Network;
use crate::ops::Engine;
use crate::spec::DataPlacement;
use crate::tensor::RowsAt;

/// A split's samples, and where each one's inputs and targets lie in them.
pub struct Samples<B: Engine> {
    store: Store<B>,
    inputs: RowsAt,
    targets: RowsAt,
    /// The targets are read from the features: a text's next tokens.
    targets_in_features: bool,
}

/// Features and targets, row by row (a text's targets: empty).
enum Store<B: Engine> {
    /// Uploaded once; a batch is a gather on the device.
    Resident { x: B::Buf, y: B::Buf },
    /// In host memory; a batch is gathered there and copied.
    Streamed { x: Vec<f32>, y: Vec<f32> },
}

impl<B: Engine> Samples<B> {
    /// `set`'s samples of `row_len` input values and `target_dim` targets each.
    pub fn new(
        backend: &B,
        set: Dataset,
        (row_len, target_dim): (usize, usize),
        resident: bool,
    ) -> Result<Self> {
        let (inputs, targets, targets_in_features) = match set.windows {
            // Windows of tokens `stride` apart; the targets are the next tokens.
            Some(stride) => {
                let at = |offset| RowsAt {
                    len: row_len,
                    stride,
                    offset,
                };
                (at(0), at(1), true)
            }
            None => (RowsAt::packed(row_len), RowsAt::packed(target_dim), false),
        };
        let store = if resident {
            Store::Resident {
                x: backend.upload_vec(set.features)?,
                y: backend.upload_vec(set.targets)?,
            }
        } else {
            Store::Streamed {
                x: set.features,
                y: set.targets,
            }
        };
        Ok(Samples {
            store,
            inputs,
            targets,
            targets_in_features,
        })
    }

    /// Puts the samples `rows` into the network's input and target buffers.
    pub fn load(&self, backend: &B, rows: &[u32], net: &mut Network<B>) {
        match &self.store {
            Store::Resident { x, y } => {
                let y = if self.targets_in_features { x } else { y };
                backend.gather_rows(x, rows, self.inputs, net.input_mut());
                backend.gather_rows(y, rows, self.targets, net.targets_mut());
            }
            Store::Streamed { x, y } => {
                let y = if self.targets_in_features { x } else { y };
                backend.upload_rows(x, rows, self.inputs, net.input_mut());
                backend.upload_rows(y, rows, self.targets, net.targets_mut());
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

/// Whether the data set (`bytes`, every split) is uploaded whole. "auto" uploads it when it
/// fits in the device memory still free, with a margin for the scratch that grows during
/// the first steps; call it after the network and the optimizer have their memory.
pub fn resident<B: Engine>(backend: &B, placement: DataPlacement, bytes: usize) -> bool {
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    match placement {
        DataPlacement::Resident => true,
        DataPlacement::Streamed => {
            if backend.free_memory().is_some() {
                tracing::info!(
                    "data: streamed from pinned host memory (device.data = \"streamed\")"
                );
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
