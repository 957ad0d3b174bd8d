//! What an op's forward and backward passes see of the executor's buffers: its inputs and
//! output, their gradients, the parameters, its state and scratch. The executor (`graph::
//! Network`) builds one per layer and pass; an op borrows what it needs through `io`.

use crate::tensor::{Backend, GradWrite, HalfKind};

/// Which forward pass a layer runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Train,
    /// Training, again: activation checkpointing recomputing a segment in backward.
    Recompute,
    /// Evaluation: dropout off, batch norm on its running statistics.
    Eval,
}

/// Passes an in-place activation saves its neighbours. Mixed precision rounds each op's
/// output (and in backward its input gradient) in a pass of its own. Where that value's only
/// reader is the in-place activation beside it, the activation rounds it in its own pass
/// instead (`Backend::activation_in_place_rounding`, `activation_backward_rounding`): the same
/// values, one pass over the buffer fewer (on an H100, 0.3 ms of the bf16 4096-MLP's 3.3 ms
/// step went to such passes). And a ReLU that is the only reader of a linear layer's output
/// is applied by that layer's product (`Backend::linear_forward`'s `then`: on CUDA in
/// cuBLASLt's epilogue, with the bias), in any precision. Flags of an activation layer; all
/// false elsewhere.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fusion {
    /// Forward: it rounds its input, which the layer before leaves unrounded.
    pub input: bool,
    /// Backward: it rounds its output's gradient, which the layer after leaves unrounded.
    pub grad: bool,
    /// Forward: the linear layer before it applies it (and this layer does nothing). Its
    /// input is then rounded by that layer's own rounding, after the ReLU: the same values,
    /// as ReLU keeps a half value one.
    pub by_product: bool,
}

/// Where a layer's dropout mask comes from: the stream's key for this layer and micro-step,
/// and the position of the layer's first output value in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mask {
    pub key: u64,
    pub first: u64,
    /// The batch's first sample in the micro-batch (not 0 for a data-parallel replica's
    /// share), for masks over something other than the output.
    pub sample: u64,
}

/// What an op's backward pass leaves to the executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dx {
    /// It wrote its input gradient (where one is needed) to `Grads::dx`: the executor adds
    /// it where other layers' gradients of the same value are, and rounds it in mixed
    /// precision, unless `exact` (a ReLU's dx is dy or 0, already a half value).
    Written { exact: bool },
    /// It did everything, or there was nothing to do.
    Done,
}

/// Rounds `buf`'s first `len` values to the half format in mixed precision.
pub fn round<B: Backend>(backend: &B, half: Option<HalfKind>, buf: &mut B::Buf, len: usize) {
    if let Some(kind) = half {
        backend.round_to_half(kind, buf, len);
    }
}

/// One layer's forward pass.
pub struct Forward<'a, B: Backend> {
    pub backend: &'a B,
    /// Samples in the batch.
    pub n: usize,
    pub pass: Pass,
    /// Values of the output: `n` samples.
    pub out_len: usize,
    /// Mixed precision's half format.
    pub half: Option<HalfKind>,
    /// It writes over its first input, which is in the output buffer already.
    pub in_place: bool,
    pub fusion: Fusion,
    /// The ReLU after it is applied by its product (`Fusion::by_product`).
    pub relu_after: bool,
    pub mask: Mask,
    /// The position of the sequence's first value in this pass: 0, but for a model that
    /// reads one token a step (`Graph::for_decoding`).
    pub position: usize,
    /// The fp32 parameters.
    pub params: &'a B::Buf,
    /// The parameters products compute with: their half copy in mixed precision.
    pub weights: &'a B::Buf,
    pub state: &'a mut B::Buf,
    pub workspace: &'a mut B::Buf,
    pub(crate) acts: &'a mut [B::Buf],
    /// The nodes it reads, and the activation buffer of each node.
    pub(crate) inputs: &'a [usize],
    pub(crate) slot: &'a [usize],
    pub(crate) out_slot: usize,
    /// The data's token ids (an embedding's input).
    pub ids: &'a B::Ids,
}

/// An op's first input and its output, with the rest it may read or write.
pub struct Io<'s, B: Backend> {
    pub x: &'s B::Buf,
    pub y: &'s mut B::Buf,
    pub params: &'s B::Buf,
    pub weights: &'s B::Buf,
    pub state: &'s mut B::Buf,
    pub workspace: &'s mut B::Buf,
}

impl<B: Backend> Forward<'_, B> {
    /// Its number of inputs.
    pub fn inputs(&self) -> usize {
        self.inputs.len()
    }

    /// The first input and the output.
    pub fn io(&mut self) -> Io<'_, B> {
        let (x, y) = read_write(self.acts, self.slot[self.inputs[0]], self.out_slot);
        Io {
            x,
            y,
            params: self.params,
            weights: self.weights,
            state: self.state,
            workspace: self.workspace,
        }
    }

    /// Input `k` and the output.
    pub fn input_and_output(&mut self, k: usize) -> (&B::Buf, &mut B::Buf) {
        read_write(self.acts, self.slot[self.inputs[k]], self.out_slot)
    }

    /// The first two inputs and the output, which has its own buffer.
    pub fn two_inputs_and_output(&mut self) -> (&B::Buf, &B::Buf, &mut B::Buf) {
        let [a, b] = [0, 1].map(|k| self.slot[self.inputs[k]]);
        let (below, rest) = self.acts.split_at_mut(self.out_slot);
        let (y, above) = rest.split_first_mut().expect("the output's buffer");
        let (below, above) = (&*below, &*above);
        let slot = |s: usize| match s < self.out_slot {
            true => &below[s],
            false => &above[s - self.out_slot - 1],
        };
        (slot(a), slot(b), y)
    }

    /// The output alone (an op running in place).
    pub fn output(&mut self) -> &mut B::Buf {
        &mut self.acts[self.out_slot]
    }

    /// The output and the workspace (an op running in place that needs scratch).
    pub fn output_and_workspace(&mut self) -> (&mut B::Buf, &mut B::Buf) {
        (&mut self.acts[self.out_slot], self.workspace)
    }
}

/// One layer's backward pass.
pub struct Backward<'a, B: Backend> {
    pub backend: &'a B,
    pub n: usize,
    /// Values of one sample's output.
    pub sample_len: usize,
    /// Values of the output: `n` samples.
    pub out_len: usize,
    pub half: Option<HalfKind>,
    /// Whether the parameter gradients are written or added to.
    pub dw: GradWrite,
    pub fusion: Fusion,
    pub mask: Mask,
    /// It takes the gradient through the ReLU before it (`OpKind::takes_gradient_through_relu`).
    pub through_relu: bool,
    /// A ReLU whose gradient the layer after it took through it already.
    pub taken_through: bool,
    pub params: &'a B::Buf,
    pub weights: &'a B::Buf,
    pub grads: &'a mut B::Buf,
    pub state: &'a B::Buf,
    pub workspace: &'a mut B::Buf,
    pub(crate) acts: &'a [B::Buf],
    pub(crate) dacts: &'a mut [B::Buf],
    /// Where an input gradient goes before it is added to the one other layers wrote.
    pub(crate) dscratch: &'a mut B::Buf,
    /// The data's token ids (an embedding's input).
    pub ids: &'a B::Ids,
    /// The nodes it reads, and the activation and gradient buffer of each node.
    pub(crate) inputs: &'a [usize],
    pub(crate) slot: &'a [usize],
    pub(crate) grad_slot: &'a [usize],
    pub(crate) out_slot: usize,
    pub(crate) out_grad_slot: usize,
    /// Per input: whether its gradient adds to one other layers wrote.
    pub(crate) accumulate: &'a [bool],
    /// Per input: whether it is the data, which needs no gradient.
    pub(crate) is_data: &'a [bool],
}

/// What an op's backward step reads and writes.
pub struct Grads<'s, B: Backend> {
    pub x: &'s B::Buf,
    pub y: &'s B::Buf,
    pub dy: &'s B::Buf,
    /// Where the first input's gradient goes; None where none is needed (the data).
    pub dx: Option<&'s mut B::Buf>,
    pub params: &'s B::Buf,
    pub weights: &'s B::Buf,
    pub grads: &'s mut B::Buf,
    pub state: &'s B::Buf,
    pub workspace: &'s mut B::Buf,
}

impl<'a, B: Backend> Backward<'a, B> {
    /// Its number of inputs.
    pub fn inputs(&self) -> usize {
        self.inputs.len()
    }

    /// Whether the first input needs a gradient (it is not the data).
    pub fn needs_dx(&self) -> bool {
        !self.is_data[0]
    }

    /// The first input's values and gradient, the output's, and the rest.
    pub fn io(&mut self) -> Grads<'_, B> {
        let (src, dsrc) = (self.slot[self.inputs[0]], self.grad_slot[self.inputs[0]]);
        let x = &self.acts[src];
        let (dy, dx) = if self.is_data[0] {
            (&self.dacts[self.out_grad_slot], None)
        } else if self.accumulate[0] {
            (&self.dacts[self.out_grad_slot], Some(&mut *self.dscratch))
        } else {
            let (dy, dx) = read_write(self.dacts, self.out_grad_slot, dsrc);
            (dy, Some(dx))
        };
        Grads {
            x,
            y: &self.acts[self.out_slot],
            dy,
            dx,
            params: self.params,
            weights: self.weights,
            grads: self.grads,
            state: self.state,
            workspace: self.workspace,
        }
    }

    /// The first input and output, and their gradients, both writable: for an activation
    /// that rounds dy itself (`Fusion::grad`), whose dx has its own buffer.
    pub fn io_rounding_dy(&mut self) -> (&B::Buf, &B::Buf, &mut B::Buf, &mut B::Buf) {
        let input = self.inputs[0];
        let (dy, dx) = two_mut(self.dacts, self.out_grad_slot, self.grad_slot[input]);
        (
            &self.acts[self.slot[input]],
            &self.acts[self.out_slot],
            dy,
            dx,
        )
    }

    /// Input `k`'s values.
    pub fn input(&self, k: usize) -> &'a B::Buf {
        &self.acts[self.slot[self.inputs[k]]]
    }

    /// The output's gradient and input `k`'s, and whether it adds to what other layers
    /// wrote there; None for the data.
    pub fn dy_and_input_grad(&mut self, k: usize) -> Option<(&B::Buf, &mut B::Buf, bool)> {
        if self.is_data[k] {
            return None;
        }
        let dx = self.grad_slot[self.inputs[k]];
        let (dy, dx) = read_write(self.dacts, self.out_grad_slot, dx);
        Some((dy, dx, self.accumulate[k]))
    }
}

/// Two distinct elements of a slice, one shared and one mutable.
pub(crate) fn read_write<T>(v: &mut [T], read: usize, write: usize) -> (&T, &mut T) {
    assert_ne!(read, write, "a layer cannot read and write the same buffer");
    if read < write {
        let (a, b) = v.split_at_mut(write);
        (&a[read], &mut b[0])
    } else {
        let (a, b) = v.split_at_mut(read);
        (&b[0], &mut a[write])
    }
}

/// Two different elements of `v`, both writable.
fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert_ne!(a, b, "two_mut needs two different buffers");
    if a < b {
        let (x, y) = v.split_at_mut(b);
        (&mut x[a], &mut y[0])
    } else {
        let (x, y) = v.split_at_mut(a);
        (&mut y[0], &mut x[b])
    }
}
