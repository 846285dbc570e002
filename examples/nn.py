"""Tiny numpy building blocks for the examples: layers with forward + backward.

Every function is pure numpy. A layer's ``*_backward`` takes the gradient of
the loss with respect to the layer's output and returns the gradients with
respect to its inputs and parameters. ``MLP`` strings dense layers and ReLUs
together, creates its variables through a ``ParameterServerStrategy``, and
``make_train_step`` turns it into a step function for a ``ClusterCoordinator``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from coordinator import push_gradients, read_variables


# -- layers --------------------------------------------------------------------------
def dense(x, w, b):
    """y = x @ w + b."""
    return x @ w + b


def dense_backward(dy, x, w, need_dx: bool = True):
    """Gradients (dx, dw, db) of y = x @ w + b, given dy. ``need_dx=False``:
    dx is None (a first layer, whose input is data: as autodiff, which
    never computes a gradient nobody asked for)."""
    return (dy @ w.T if need_dx else None), x.T @ dy, dy.sum(axis=0)


def relu(x):
    return np.maximum(x, 0)


def relu_backward(dy, x):
    return dy * (x > 0)


# -- losses: (mean loss over the batch, gradient w.r.t. the predictions) ---------------
def mse(pred, y):
    """Mean squared error over every element."""
    diff = pred - y
    return float(np.mean(diff * diff)), 2.0 * diff / diff.size


def softmax(logits):
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def softmax_cross_entropy(logits, labels):
    """Softmax cross-entropy with integer class labels, mean over the batch (stable)."""
    n = logits.shape[0]
    z = logits - logits.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    loss = -log_p[np.arange(n), labels].mean()
    grad = np.exp(log_p)
    grad[np.arange(n), labels] -= 1
    return float(loss), grad / n


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))      # stable for any x


def sigmoid_cross_entropy(logits, labels):
    """Binary cross-entropy on logits with 0/1 labels, mean over the batch (stable)."""
    # log(1 + exp(-|x|)) + max(x, 0) - x * y, as tf.nn.sigmoid_cross_entropy_with_logits.
    loss = np.logaddexp(0, -np.abs(logits)) + np.maximum(logits, 0) - logits * labels
    return float(loss.mean()), (sigmoid(logits) - labels) / logits.size


LOSSES = {"softmax_cross_entropy": softmax_cross_entropy, "mse": mse,
          "sigmoid_cross_entropy": sigmoid_cross_entropy}


# -- a multi-layer perceptron ------------------------------------------------------------
class MLP:
    """Dense layers with ReLU between them; ``sizes`` = [inputs, hidden..., outputs].

    Parameters are a flat list [kernel0, bias0, kernel1, bias1, ...] of numpy
    arrays, in the order of ``self.variables``. The object holds only sizes
    and variable handles, so step functions can capture it and go to workers.
    """

    def __init__(self, sizes: Sequence[int], loss: str = "softmax_cross_entropy"):
        if len(sizes) < 2:
            raise ValueError("an MLP needs at least an input and an output size")
        self.sizes, self.loss = [int(s) for s in sizes], loss
        self.variables: list = []

    def create_variables(self, strategy, name: str = "mlp", *, optimizer: str = "adam",
                         optimizer_params: dict | None = None, seed: int = 0) -> list:
        """Glorot-uniform kernels (seeded per layer) and zero biases on the servers."""
        self.variables = []
        for i, (n_in, n_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            for kind, shape, init in (("kernel", (n_in, n_out), "glorot_uniform"),
                                      ("bias", (n_out,), "zeros")):
                self.variables.append(strategy.create_variable(
                    f"{name}/dense_{i}/{kind}", shape, initializer=init, seed=seed + 1000 * i,
                    optimizer=optimizer, optimizer_params=optimizer_params))
        return self.variables

    def init_params(self, seed: int = 0, dtype="float64") -> list[np.ndarray]:
        """Local numpy parameters with the same scheme (for tests and experiments)."""
        rng = np.random.default_rng(seed)
        params = []
        for n_in, n_out in zip(self.sizes[:-1], self.sizes[1:]):
            limit = np.sqrt(6.0 / (n_in + n_out))
            params += [rng.uniform(-limit, limit, (n_in, n_out)).astype(dtype),
                       np.zeros(n_out, dtype)]
        return params

    def forward(self, params, x):
        """Output logits/predictions and the per-layer inputs kept for backward."""
        inputs = []
        h = x
        n_layers = len(params) // 2
        for i in range(n_layers):
            w, b = params[2 * i], params[2 * i + 1]
            inputs.append(h)
            h = dense(h, w, b)
            if i < n_layers - 1:
                inputs.append(h)       # pre-activation, for relu_backward
                h = relu(h)
        return h, inputs

    def predict(self, params, x):
        return self.forward(params, x)[0]

    def loss_and_grads(self, params, x, y):
        """(mean loss, [gradient of each parameter]) on one batch."""
        out, inputs = self.forward(params, x)
        loss, d = LOSSES[self.loss](out, y)
        grads = [None] * len(params)
        for i in reversed(range(len(params) // 2)):
            if i < len(params) // 2 - 1:
                d = relu_backward(d, inputs.pop())
            d, grads[2 * i], grads[2 * i + 1] = dense_backward(d, inputs.pop(), params[2 * i],
                                                               need_dx=i > 0)
        return loss, grads


def make_train_step(model: MLP, *, compression=None, read_compression=None):
    """A step function for ``ClusterCoordinator.schedule(step, args=(iterator,))``.

    On a worker it takes a batch, reads the model's variables (one call per
    parameter server), computes the loss and gradients, pushes the gradients
    (one call per server) and returns the loss. It captures only the model
    (sizes and variable handles), so cloudpickle can send it by value.
    ``compression`` / ``read_compression``: the strategy's
    ``gradient_compression_spec`` / ``read_compression_spec`` (None: off).
    """
    variables = list(model.variables)

    def train_step(iterator):
        x, y = next(iterator)
        params = read_variables(variables, compression=read_compression)
        loss, grads = model.loss_and_grads(params, x, y)
        push_gradients(zip(variables, grads), compression=compression)
        return loss

    return train_step
