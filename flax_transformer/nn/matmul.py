"""The model's matmuls: operands in the compute dtype, products accumulated in float32.

A bfloat16 x bfloat16 -> bfloat16 `dot` is not what a CPU runs fast: XLA's CPU
backend upcasts it to float32 x float32 (plus conversion passes), while
bfloat16 x bfloat16 -> float32 goes to native bfloat16 kernels at about twice
the float32 rate. Plain autodiff of that dot would then multiply the float32
cotangent by a bfloat16 operand, i.e. in float32 again, so `dense_dot` has its
own VJP that rounds the cotangent to the compute dtype first: all three
matmuls of a layer (forward, input gradient, weight gradient) run in bfloat16
with float32 accumulation, and the weight gradient is returned in float32,
unrounded. In float32 it is exactly the ordinary dot and its autodiff.

Axis legend: X contracted (input features), Y output features; `...` any
leading axes (batch, length).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense_dot(x: jax.Array, kernel: jax.Array, kernel_axis: int = 0) -> jax.Array:
  """`x` `[..., X]` times `kernel` -> float32 `[..., Y]`.

  `kernel` is `[X, Y]` (`kernel_axis=0`, a Dense kernel) or `[Y, X]`
  (`kernel_axis=1`: an embedding table `[V, D]` used as the output projection,
  without materialising its transpose). `x` is in the compute dtype; `kernel`
  (float32 parameters) is cast to it for the product, which is accumulated in
  float32. The gradients come back in each argument's own dtype: `x`'s in the
  compute dtype, `kernel`'s in float32.
  """
  return _dot(x, kernel.astype(x.dtype), kernel_axis)


def _dot(x, kernel, kernel_axis):
  # Contract x's last axis with the kernel's X axis: [..., X] -> [..., Y], float32.
  return lax.dot_general(
    x, kernel, (((x.ndim - 1,), (kernel_axis,)), ((), ())), preferred_element_type=jnp.float32
  )


def _dense_dot_fwd(x, kernel, kernel_axis):
  kernel_c = kernel.astype(x.dtype)
  # Saved in the compute dtype; the zero-size array only remembers the kernel's dtype.
  return _dot(x, kernel_c, kernel_axis), (x, kernel_c, jnp.zeros((0,), kernel.dtype))


def _dense_dot_bwd(kernel_axis, residuals, grad):
  x, kernel, kernel_dtype = residuals
  grad = grad.astype(x.dtype)  # [..., Y]
  # d x = grad kernel^T: contract Y, [..., Y] -> [..., X]
  dx = lax.dot_general(
    grad,
    kernel,
    (((grad.ndim - 1,), (1 - kernel_axis,)), ((), ())),
    preferred_element_type=jnp.float32,
  )
  # d kernel = x^T grad ([X, Y]) or grad^T x ([Y, X]), summed over all leading axes.
  if x.dtype == jnp.float32:
    # In float32 the leading axes are flattened first (a free reshape): XLA's CPU backend
    # then reads both operands in place, where contracting [B, L] of 3-D ones it first copies
    # the activations transposed into [X, B*L] (15-20 ms for each feed-forward's [8192, 512]
    # hidden units in the Multi30k step). In bfloat16 the flattened product runs on a slower
    # kernel: the bfloat16 step was 4% slower with it (docs/training_step.md).
    x, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
  leading = tuple(range(x.ndim - 1))
  pair = (x, grad) if kernel_axis == 0 else (grad, x)
  dkernel = lax.dot_general(
    *pair, ((leading, leading), ((), ())), preferred_element_type=jnp.float32
  )
  return dx.astype(x.dtype), dkernel.astype(kernel_dtype.dtype)


dense_dot.defvjp(_dense_dot_fwd, _dense_dot_bwd)


class Dense(nn.Module):
  """`nn.Dense` with the same parameters ('kernel' `[X, Y]`, 'bias' `[Y]`, float32) on `dense_dot`.

  The input is cast to `dtype`, the product and the bias are summed in
  float32, and the result is returned in `dtype`, as `nn.Dense(dtype=...)` does.
  """

  features: int
  dtype: jnp.dtype = jnp.float32
  use_bias: bool = True
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
  bias_init: nn.initializers.Initializer = nn.initializers.zeros_init()

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """`[..., X]` -> `[..., features]`."""
    kernel = self.param('kernel', self.kernel_init, (x.shape[-1], self.features), jnp.float32)
    y = dense_dot(x.astype(self.dtype), kernel)
    if self.use_bias:
      y = y + self.param('bias', self.bias_init, (self.features,), jnp.float32)
    return y.astype(self.dtype)
