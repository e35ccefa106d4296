# requires: optax, sklearn
"""Train a digit classifier whose layers are vjpkit Functions.

    pip install -e ".[examples]"
    python examples/train_mlp.py

The data is scikit-learn's bundled digits (1,797 8x8 images; nothing is
downloaded). The model is Linear -> ReLU -> Linear -> ReLU -> Linear with a
fused softmax-cross-entropy loss, all four ops being vjpkit Functions from
``layers.py``. Each layer is gradchecked first, then one ``jax.jit``-compiled
step (forward, backward through the Functions' own ``backward`` rules, optax
Adam update) runs over shuffled mini-batches. It prints one line per epoch,
ends with the test accuracy, and writes ``train_mlp_loss.png`` when
matplotlib is installed.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from layers import gradcheck_layers, linear, relu, softmax_cross_entropy
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

SIZES = (64, 128, 128, 10)


def load_data(seed=0):
    """Digits scaled to [0, 1], split 80/20 with a fixed seed (float32/int32)."""
    images, labels = load_digits(return_X_y=True)
    x = (images / 16.0).astype(np.float32)
    y = labels.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)


def init_params(key, sizes=SIZES):
    """One ``(w, b)`` per layer; ``w`` is ``(out, in)`` as in ``torch.nn.Linear``."""
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        key, sub = jax.random.split(key)
        bound = 1.0 / np.sqrt(n_in)
        w = jax.random.uniform(sub, (n_out, n_in), minval=-bound, maxval=bound)
        params.append((w, jnp.zeros(n_out)))
    return params


def predict(params, x):
    """The logits: every layer but the last is followed by a ReLU."""
    *hidden, (w_out, b_out) = params
    for w, b in hidden:
        x = relu(linear(x, w, b))
    return linear(x, w_out, b_out)


def loss_fn(params, x, y):
    return softmax_cross_entropy(predict(params, x), y)


def make_train_step(optimizer, loss=loss_fn):
    """One jit-compiled optimisation step: gradients, update, new parameters."""

    @jax.jit
    def train_step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return train_step


@jax.jit
def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(predict(params, x), axis=-1) == y)


def batches(x, y, batch_size, rng):
    """Shuffled full batches (the remainder is dropped, so shapes never change)."""
    order = rng.permutation(len(x))
    for start in range(0, len(x) - batch_size + 1, batch_size):
        idx = order[start : start + batch_size]
        yield x[idx], y[idx]


def train(epochs=30, batch_size=64, learning_rate=1e-3, seed=0, log=print):
    """Trains the classifier; returns the parameters and per-epoch history.

    The first epoch's time includes compiling the train step.
    """
    x_train, x_test, y_train, y_test = load_data(seed)
    params = init_params(jax.random.key(seed))
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    train_step = make_train_step(optimizer)
    rng = np.random.default_rng(seed)

    history = {"loss": [], "test_accuracy": []}
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        losses = []
        for xb, yb in batches(x_train, y_train, batch_size, rng):
            params, opt_state, loss = train_step(params, opt_state, xb, yb)
            losses.append(loss)
        epoch_loss = float(jnp.mean(jnp.stack(losses)))
        test_acc = float(accuracy(params, x_test, y_test))
        elapsed = time.perf_counter() - start
        history["loss"].append(epoch_loss)
        history["test_accuracy"].append(test_acc)
        log(
            f"epoch {epoch:3d}  loss {epoch_loss:.4f}  "
            f"test accuracy {test_acc:6.2%}  time {elapsed * 1e3:4.0f} ms"
        )
    return params, history


def plot_loss(history, path):
    """Writes the loss curve to ``path``; returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5, 3.5))
    epochs = range(1, len(history["loss"]) + 1)
    ax.plot(epochs, history["loss"], marker="o", markersize=3)
    ax.set(xlabel="epoch", ylabel="mean training loss", yscale="log")
    ax.set_title("digits MLP with vjpkit layers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--plot", default="train_mlp_loss.png", help="loss-curve PNG path ('' to skip)")
    args = parser.parse_args()

    start = time.perf_counter()
    print("gradcheck:", ", ".join(f"{name} ok" for name in gradcheck_layers()))
    _, history = train(epochs=args.epochs)
    print(f"test accuracy: {history['test_accuracy'][-1]:.2%} ({time.perf_counter() - start:.1f}s in all)")
    if args.plot and plot_loss(history, args.plot):
        print(f"loss curve: {args.plot}")


if __name__ == "__main__":
    main()
